#!/usr/bin/env bash
# launcher.sh: start a JAXformer run on every host in parallel (one run.sh per host), log per host.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: launcher.sh (--hosts FILE | --tpu NAME --zone ZONE [--project P]) [options] [-- MAIN_ARGS...]

Runs `run.sh HOST --index I --num-processes N ...` for every host at once: host I becomes jax process
I, in tmux session RUN-I on that host. Each host's output goes to LOCAL_LOGS/I-HOST.log here. Exits
non-zero, naming each host that failed to start (or, with --wait, to finish).

hosts:
  --hosts FILE           one host per line ([user@]host); blank lines and # comments ignored
  --tpu NAME --zone Z    the workers of a TPU VM (gcloud compute tpus tpu-vm describe), reached
                         with `gcloud compute tpus tpu-vm ssh --worker I` unless SSH is set
  --project P            gcloud project for --tpu

options:
  --name RUN             run name (default: --name in MAIN_ARGS, else "jaxformer")
  --coordinator H:P      jax.distributed coordinator, e.g. FIRST_HOST:1234 (GPU/CPU clusters;
                         TPU pods auto-detect and need none)
  --commit SHA|asis      code version on every host (default asis; SHA refused on a dirty checkout)
  --dir DIR              checkout on the hosts (default: $JAXFORMER_DIR, else this script's directory)
  --python PY, --main SCRIPT, --log-dir DIR, --env NAME=VALUE, --force
                         passed to run.sh (see run.sh --help)
  --wait                 wait for the program on every host; exit status says which hosts failed
  --local-logs DIR       per-host logs here (default: ./logs/launch/RUN)
  --dry-run              print what each run.sh would run, run nothing
  -h, --help             this help

environment: SSH (command used as `$SSH HOST COMMAND`), WANDB_API_KEY / HF_TOKEN (sent to the hosts
on stdin by run.sh, never printed).
EOF
}

die() { echo "launcher.sh: error: $*" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=launch_lib.sh
. "$here/launch_lib.sh"   # resolve_hosts, run_name_from_args

hosts_file="" tpu="" zone="" project="" name="" local_logs="" dry_run=0
pass=() main_args=()
while (($#)); do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --hosts) hosts_file=${2?--hosts needs a FILE}; shift 2 ;;
    --tpu) tpu=${2?--tpu needs a NAME}; shift 2 ;;
    --zone) zone=${2?--zone needs a ZONE}; shift 2 ;;
    --project) project=${2?--project needs a value}; shift 2 ;;
    --name) name=${2?--name needs a value}; shift 2 ;;
    --local-logs) local_logs=${2?--local-logs needs a DIR}; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --coordinator|--commit|--dir|--python|--main|--log-dir|--env)
      pass+=("$1" "${2?$1 needs a value}"); shift 2 ;;
    --force|--wait) pass+=("$1"); shift ;;
    --) shift; main_args=("$@"); break ;;
    *) die "unknown argument '$1' (see --help; arguments for main.py go after --)" ;;
  esac
done

resolve_hosts "$hosts_file" "$tpu" "$zone" "$project"
if [[ -n $tpu ]]; then pass+=(--tpu "$tpu" --zone "$zone" ${project:+--project "$project"}); fi

run_name_from_args ${main_args[@]+"${main_args[@]}"}   # --name, else main.py's --name, else jaxformer
n=${#hosts[@]}

run_args() {  # the run.sh command line for host $1 at index $2
  printf '%s\0' "$here/run.sh" "$1" --name "$name" --index "$2" --num-processes "$n" \
    ${pass[@]+"${pass[@]}"} -- ${main_args[@]+"${main_args[@]}"}
}

if ((dry_run)); then
  echo "# launcher.sh --dry-run: run '$name' on $n host(s): ${hosts[*]}"
  for i in "${!hosts[@]}"; do
    mapfile -d '' cmd < <(run_args "${hosts[i]}" "$i")
    echo "## host $i: ${hosts[i]}"
    "${cmd[@]:0:1}" --dry-run "${cmd[@]:1}"
  done
  exit 0
fi

local_logs=${local_logs:-logs/launch/$name}
mkdir -p "$local_logs"
pids=()
for i in "${!hosts[@]}"; do
  mapfile -d '' cmd < <(run_args "${hosts[i]}" "$i")
  "${cmd[@]}" < /dev/null > "$local_logs/$i-${hosts[i]//\//_}.log" 2>&1 &
  pids+=($!)
done
echo "launcher.sh: run '$name' on $n host(s), logs in $local_logs/"

failed=()
for i in "${!hosts[@]}"; do
  log="$local_logs/$i-${hosts[i]//\//_}.log"
  if wait "${pids[i]}"; then
    echo "launcher.sh: host $i ${hosts[i]}: ok"
  else
    rc=$?
    why="exit status $rc"
    ((rc == 255)) && why="unreachable over SSH (exit 255)"
    echo "launcher.sh: host $i ${hosts[i]}: FAILED, $why; last lines of $log:" >&2
    tail -n 5 "$log" | sed 's/^/    /' >&2
    failed+=("${hosts[i]}")
  fi
done
if ((${#failed[@]})); then
  echo "launcher.sh: error: ${#failed[@]} of $n host(s) failed: ${failed[*]}" >&2
  exit 1
fi
