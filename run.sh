#!/usr/bin/env bash
# run.sh: start one process of a JAXformer run on HOST, inside a tmux session, over SSH.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: run.sh HOST [options] [-- MAIN_ARGS...]

Over SSH, start `python main.py MAIN_ARGS` on HOST inside a detached tmux session named after the
run (so it survives a dropped link), in the checkout, with its output teed to a log on the host.

options:
  --name RUN             run name: tmux session RUN (RUN-I with --index I), log RUN[-I].log
                         (default: the value of --name in MAIN_ARGS, else "jaxformer")
  --index I              this host's index in the host list (= jax process id with --coordinator)
  --num-processes N      number of hosts (jax process count with --coordinator)
  --coordinator H:P      set JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID for
                         jax.distributed.initialize (not needed on TPU pods: auto-detected)
  --dir DIR              checkout on the host (default: $JAXFORMER_DIR, else this script's directory)
  --commit SHA|asis      code version: "asis" (default) runs the checkout untouched; SHA runs
                         `git fetch` + `git checkout SHA`, refused if the checkout has local changes
  --python PY            interpreter on the host (default: DIR/.venv/bin/python if present, else python3)
  --main SCRIPT          program to run instead of main.py (path relative to DIR)
  --log-dir DIR          log directory on the host (default: CHECKOUT/logs)
  --env NAME=VALUE       extra environment for the program (repeatable); JAX_PLATFORMS, XLA_FLAGS,
                         WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY are forwarded when set locally
  --tpu NAME --zone Z    reach the host with `gcloud compute tpus tpu-vm ssh NAME --worker I`
  --project P            gcloud project for --tpu
  --force                kill an existing tmux session of the same name first
  --wait                 stay connected until the program ends; stream its log; exit with its status
  --dry-run              print what would run, run nothing
  -h, --help             this help

environment:
  SSH                    SSH command (default "ssh -o BatchMode=yes -o ConnectTimeout=15"); it is
                         called as `$SSH HOST COMMAND`, so tests can substitute a local runner
  WANDB_API_KEY, HF_TOKEN  secrets: sent to the host on stdin into a private file that the run
                         reads and deletes; never on a command line, in a pane, a log or --dry-run

exit status: 0 started (or, with --wait, finished) OK; 2 bad usage; 255 HOST unreachable; 3 no
checkout; 4 tmux missing on HOST; 5 local changes block --commit; 6 git failed; 7 session exists;
otherwise the program's exit status (--wait).
EOF
}

die() { echo "run.sh: error: $*" >&2; exit 2; }
# shellcheck source-path=SCRIPTDIR source=launch_lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/launch_lib.sh"   # run_name_from_args, q, sq

host="" name="" index="" nproc="" coordinator="" dir="${JAXFORMER_DIR:-}" commit="asis"
python="" main="main.py" log_dir="" tpu="" zone="" project="" force=0 wait=0 dry_run=0
extra_env=() main_args=()

while (($#)); do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --name) name=${2?--name needs a value}; shift 2 ;;
    --index) index=${2?--index needs a value}; shift 2 ;;
    --num-processes) nproc=${2?--num-processes needs a value}; shift 2 ;;
    --coordinator) coordinator=${2?--coordinator needs HOST:PORT}; shift 2 ;;
    --dir) dir=${2?--dir needs a value}; shift 2 ;;
    --commit) commit=${2?--commit needs a SHA or asis}; shift 2 ;;
    --python) python=${2?--python needs a value}; shift 2 ;;
    --main) main=${2?--main needs a value}; shift 2 ;;
    --log-dir) log_dir=${2?--log-dir needs a value}; shift 2 ;;
    --env) extra_env+=("${2?--env needs NAME=VALUE}"); shift 2 ;;
    --tpu) tpu=${2?--tpu needs a value}; shift 2 ;;
    --zone) zone=${2?--zone needs a value}; shift 2 ;;
    --project) project=${2?--project needs a value}; shift 2 ;;
    --force) force=1; shift ;;
    --wait) wait=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; main_args=("$@"); break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [[ -z $host ]] || die "one HOST only (got '$host' and '$1'); arguments for main.py go after --"
       host=$1; shift ;;
  esac
done

[[ -n $host ]] || { usage >&2; die "missing HOST"; }
[[ -z $index || $index =~ ^[0-9]+$ ]] || die "--index must be a non-negative integer, got '$index'"
[[ -z $nproc || $nproc =~ ^[1-9][0-9]*$ ]] || die "--num-processes must be a positive integer, got '$nproc'"
if [[ -n $coordinator ]]; then
  [[ $coordinator =~ ^[^:[:space:]]+:[0-9]+$ ]] || die "--coordinator must be HOST:PORT, got '$coordinator'"
  [[ -n $index && -n $nproc ]] || die "--coordinator needs --index and --num-processes"
  ((index < nproc)) || die "--index $index is not below --num-processes $nproc"
fi
[[ -z $tpu || -n $zone ]] || die "--tpu needs --zone"
[[ $commit == asis || $commit =~ ^[0-9a-fA-F]{4,40}$ ]] || die "--commit must be a hex SHA or 'asis', got '$commit'"
for kv in ${extra_env[@]+"${extra_env[@]}"}; do
  [[ $kv =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env needs NAME=VALUE, got '$kv'"
done

run_name_from_args ${main_args[@]+"${main_args[@]}"}   # --name, else main.py's own --name, else jaxformer
session=${name//./_}${index:+-$index}          # tmux forbids '.' and ':' in session names
[[ -n $dir ]] || dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log_dir=${log_dir:-$dir/logs}
log=$log_dir/$session.log
status_file=$log_dir/$session.exit

# ---- the program, run inside tmux on the host: env, banner, program | tee log, exit status file ----
inner="set -o pipefail; cd $(q "$dir") || exit 3"
inner+="; if [ -s \"\$1\" ]; then set -a; . \"\$1\"; set +a; fi; rm -f \"\$1\""   # secrets, then delete
for var in JAX_PLATFORMS XLA_FLAGS WANDB_MODE WANDB_PROJECT WANDB_ENTITY; do
  [[ -n ${!var:-} ]] && inner+="; export $var=$(q "${!var}")"
done
for kv in ${extra_env[@]+"${extra_env[@]}"}; do inner+="; export ${kv%%=*}=$(q "${kv#*=}")"; done
if [[ -n $coordinator ]]; then
  inner+="; export JAX_COORDINATOR_ADDRESS=$(q "$coordinator") JAX_NUM_PROCESSES=$nproc JAX_PROCESS_ID=$index"
fi
# shellcheck disable=SC2016  # expanded on the host, not here
if [[ -n $python ]]; then py=$(q "$python"); else py='$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )'; fi
cmd="$py -u $(q "$main")"
for a in ${main_args[@]+"${main_args[@]}"}; do cmd+=" $(q "$a")"; done
inner+="; echo \"run.sh: run $name process ${index:-0}/${nproc:-1} on $(q "$host"), commit \$(git rev-parse --short HEAD 2>/dev/null || echo none), \$(date -u +%FT%TZ)\" | tee -a $(q "$log")"
inner+="; echo \"run.sh: \$ \"$(q "$cmd") | tee -a $(q "$log")"
inner+="; $cmd 2>&1 | tee -a $(q "$log"); code=\${PIPESTATUS[0]}"
inner+="; echo \"run.sh: exit status \$code\" | tee -a $(q "$log"); echo \$code > $(q "$status_file")"

# ---- the command sent over SSH: checks, optional checkout, tmux session, optional wait ----
remote=$(cat <<EOF
set -euo pipefail
secrets=\$(umask 077 && mktemp "\${TMPDIR:-/tmp}/jaxformer-env.XXXXXX"); cat > "\$secrets"
fail() { rm -f "\$secrets"; echo "run.sh: error on $(q "$host"): \$2" >&2; exit "\$1"; }
cd $(q "$dir") 2>/dev/null || fail 3 $(q "no checkout at $dir (clone the repo there or pass --dir)")
command -v tmux >/dev/null || fail 4 "tmux is not installed (sudo apt-get install -y tmux)"
if [ $(q "$commit") != asis ]; then
  [ -z "\$(git status --porcelain --untracked-files=no)" ] || fail 5 $(q "the checkout $dir has local changes; commit or stash them there, or run with --commit asis")
  git cat-file -e $(q "$commit^{commit}") 2>/dev/null || git fetch --quiet || fail 6 "git fetch failed"
  git checkout --quiet --detach $(q "$commit") || fail 6 $(q "git checkout $commit failed")
fi
if tmux has-session -t $(q "=$session") 2>/dev/null; then
  [ $force = 1 ] || fail 7 $(q "tmux session '$session' is already running (attach: tmux attach -t $session; replace: --force)")
  tmux kill-session -t $(q "=$session")
fi
mkdir -p $(q "$log_dir"); rm -f $(q "$status_file")
tmux new-session -d -s $(q "$session") -x 200 -y 50 bash -c $(sq "$inner") run.sh "\$secrets"
echo "run.sh: started tmux session '$session' on $(q "$host") (tmux attach -t $session), log $(q "$log")"
if [ $wait = 1 ]; then
  pid=\$(tmux display-message -p -t $(q "=$session:") '#{pane_pid}' 2>/dev/null || true)
  if [ -n "\$pid" ]; then tail -n +1 -F --pid="\$pid" $(q "$log") 2>/dev/null || true; fi
  while tmux has-session -t $(q "=$session") 2>/dev/null; do sleep 1; done
  [ -f $(q "$status_file") ] || fail 1 "the run ended without an exit status (see $(q "$log"))"
  [ -n "\$pid" ] || cat $(q "$log")
  exit "\$(cat $(q "$status_file"))"
fi
EOF
)

if [[ -n ${SSH:-} ]]; then
  read -ra ssh_cmd <<< "$SSH"; ssh_cmd+=("$host")
elif [[ -n $tpu ]]; then
  [[ -n $index ]] || die "--tpu needs --index (the TPU worker)"
  ssh_cmd=(gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" ${project:+--project "$project"} --worker "$index" --command)
else
  ssh_cmd=(ssh -o BatchMode=yes -o ConnectTimeout=15 "$host")
fi

secret_names=()
for var in WANDB_API_KEY HF_TOKEN; do [[ -n ${!var:-} ]] && secret_names+=("$var"); done
send_secrets() { for var in ${secret_names[@]+"${secret_names[@]}"}; do printf 'export %s=%q\n' "$var" "${!var}"; done; }

if ((dry_run)); then
  echo "# run.sh --dry-run: would run on $host, session '$session', log $log"
  echo "# secrets sent on stdin (values withheld): ${secret_names[*]:-none}"
  printf '%q ' "${ssh_cmd[@]}"; echo "\"bash -c '\$REMOTE'\"   # where REMOTE is:"
  printf '%s\n' "$remote"
  exit 0
fi

set +e
send_secrets | "${ssh_cmd[@]}" "bash -c $(sq "$remote")"
rc=${PIPESTATUS[1]}
set -e
if ((rc == 255)); then
  echo "run.sh: error: cannot reach $host over SSH (${ssh_cmd[0]} exited 255)" >&2
fi
exit "$rc"
