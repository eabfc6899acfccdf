#!/usr/bin/env bash
# launcher.sh: start a JAXformer run on every host in parallel (one run.sh per host), log per host;
# show or stop a run on every host.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: launcher.sh (--hosts FILE | --tpu NAME[,NAME...] --zone ZONE [--project P]) [options] [-- MAIN_ARGS...]
       launcher.sh (--status RUN | --stacks RUN | --stop RUN) (--hosts FILE | --tpu ...) [--dir D] [--log-dir D]

Runs `run.sh HOST --index I --num-processes N ...` for every host at once: host I becomes jax process
I, in tmux session RUN-I on that host. Each host's output goes to LOCAL_LOGS/I-HOST.log here. A host
is ok once main.py there has passed start-up (its first training step is dispatched); a host whose
program ends first, or does not get there within --timeout, FAILED: the launcher shows the last
lines of its log, stops the run on the other hosts (unless --keep-going) and exits 1. A host whose
main.py ended by its hang watchdog (exit 3: no progress for --hang_timeout s) points at another that
stopped: the launcher waits $LAUNCHER_HANG_GRACE_S (default 30) s for the other hosts' watchdogs and
names each host whose program did not end by its own as HUNG, with why (run.sh --stacks).

hosts:
  --hosts FILE           one [user@]host per line; blank lines, # comments and CRLF line ends are fine
  --tpu NAME --zone Z    the workers of a TPU VM (gcloud compute tpus tpu-vm describe), reached
                         with `gcloud compute tpus tpu-vm ssh NAME --worker W` unless SSH is set
  --tpu NAME1,NAME2,...  one run over several TPU slices of one type (data parallelism over the
                         data-center network): the hosts are slice 0's workers, then slice 1's, ...;
                         host I = slice S worker W is jax process I = S * WORKERS_PER_SLICE + W.
                         Every launch computes each host's MEGASCALE_COORDINATOR_ADDRESS (slice 0
                         worker 0's IP:--megascale-port), MEGASCALE_PORT, MEGASCALE_NUM_SLICES,
                         MEGASCALE_SLICE_ID and JAX_COORDINATOR_ADDRESS (default: slice 0 worker 0's
                         IP:8476), JAX_NUM_PROCESSES, JAX_PROCESS_ID from the TPUs' IPs now, and
                         gives main.py --n_slices N (one that differs from the number of TPUs is
                         an error). TPUs of different types are an error. --status, --stacks,
                         --stop, --dry-run and --retries span every host of every TPU.
  --project P            gcloud project for --tpu

options:
  --name RUN             the run's one name: tmux sessions RUN-I, logs, and main.py's --name
                         (default: --name in MAIN_ARGS, else "jaxformer"; the two must not differ)
  --coordinator H:P      jax.distributed coordinator, e.g. FIRST_HOST:1234, needed with several
                         hosts off a TPU pod (else each host would train on its own); "auto": the
                         hosts are TPU pod workers, which find their coordinator themselves (over
                         several TPUs, jax derives it from the MEGASCALE_* variables)
  --megascale-port P     several TPUs: the port of MEGASCALE_COORDINATOR_ADDRESS (default 8081)
  --commit SHA|asis      code version on every host (default asis; SHA refused on a dirty checkout)
  --dir DIR              checkout on the hosts (default: $JAXFORMER_DIR, else this script's directory)
  --python PY, --main SCRIPT, --log-dir DIR, --env NAME=VALUE, --force
                         passed to run.sh (see run.sh --help)
  --timeout S            seconds to wait for every host to pass start-up, or with --stop for
                         every run to end (default 900)
  --wait                 wait for the program on every host to finish; exit status says which failed
  --retries N            supervise: --wait, and when the run ends abnormally (a host FAILED, a TPU
                         preempted), wait for every --tpu to be READY again and relaunch the same
                         command (main.py resumes from its newest checkpoint), up to N times; the
                         relaunch looks up every TPU's IPs again and computes every host's
                         environment anew. A run that fails the same way at the same step twice, or
                         with a usage error (2), is not retried. Each retry is logged with its
                         cause. A preempted TPU VM stays PREEMPTED until deleted and created again:
  --recreate CMD         with --retries and --tpu: for each TPU that is PREEMPTED, TERMINATED or
                         gone, run CMD here with bash and TPU_NAME set to that TPU's name (it deletes
                         and creates the TPU or its queued resource, e.g. 'gcloud compute tpus tpu-vm
                         delete $TPU_NAME --zone Z --quiet; gcloud compute tpus tpu-vm create
                         $TPU_NAME --zone Z --accelerator-type v4-32 --version tpu-ubuntu2204-base
                         --spot', in single quotes), then wait for READY
  --setup CMD            after --recreate: run CMD on every (new) host of the recreated TPU before
                         the relaunch (run.sh --setup), e.g. "git clone URL JAXformer; cd JAXformer
                         && ./setup_tpu.sh"
  --keep-going           on a failure, leave the run going on the other hosts
  --local-logs DIR       per-host logs here (default: ./logs/launch/RUN)
  --status RUN           per host: tmux session running or not, its newest step and "no step for
                         N min", what it is doing, the last step and loss in its log, how long ago
                         its log changed; its goodput so far and (host 0) the whole run's
  --stacks RUN           per host: the program's thread stacks now (SIGUSR1; main.py goes on), or
                         why it cannot answer (stopped, gone), or the newest dump in its log
  --stop RUN             SIGTERM to main.py on every host (it saves a checkpoint and exits 0), then
                         wait up to --timeout for every session to end
  --dry-run              print what each run.sh would run, run nothing
  -h, --help             this help

environment: SSH (command used as `$SSH HOST COMMAND`), WANDB_API_KEY / HF_TOKEN (sent to the hosts
on stdin by run.sh, never printed), LAUNCHER_POLL_S (--retries: seconds between TPU state polls,
default 30), LAUNCHER_HANG_GRACE_S (default 30), RUN_STACKS_WAIT_S (run.sh --stacks, default 10).
EOF
}

die() { echo "launcher.sh: error: $*" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=launch_lib.sh
. "$here/launch_lib.sh"   # value, resolve_hosts, run_name_from_args, arg_value

hosts_file="" tpu="" zone="" project="" name="" local_logs="" coordinator="" timeout=900
mode=start dry_run=0 wait=0 keep_going=0 retries=0 recreate="" setup="" main=main.py megascale_port=8081
args=("$@") supervised=()   # the command line; supervised: it without --retries, for each attempt
where=() pass=() main_args=()   # run.sh options: where the run lives (every mode); how to start it
while (($#)); do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --hosts) hosts_file=$(value "$@"); shift 2 ;;
    --tpu) tpu=$(value "$@"); shift 2 ;;
    --zone) zone=$(value "$@"); shift 2 ;;
    --project) project=$(value "$@"); shift 2 ;;
    --name) name=$(value "$@"); shift 2 ;;
    --status|--stop|--stacks) mode=${1#--}; name=$(value "$@"); shift 2 ;;
    --coordinator) coordinator=$(value "$@"); shift 2 ;;
    --megascale-port) megascale_port=$(value "$@"); shift 2 ;;
    --timeout) timeout=$(value "$@"); shift 2 ;;
    --local-logs) local_logs=$(value "$@"); shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --wait) wait=1; shift ;;
    --keep-going) keep_going=1; shift ;;
    --retries) retries=$(value "$@"); shift 2 ;;
    --recreate) recreate=$(value "$@"); shift 2 ;;
    --setup) setup=$(value "$@"); shift 2 ;;
    --dir|--log-dir) where+=("$1" "$(value "$@")"); shift 2 ;;
    --main) main=$(value "$@"); pass+=("$1" "$main"); shift 2 ;;
    --commit|--python|--env) pass+=("$1" "$(value "$@")"); shift 2 ;;
    --force) pass+=("$1"); shift ;;
    --) shift; main_args=("$@"); break ;;
    *) die "unknown argument '$1' (see --help; arguments for main.py go after --)" ;;
  esac
done
[[ $timeout =~ ^[1-9][0-9]*$ ]] || die "--timeout must be a positive number of seconds, got '$timeout'"
[[ $retries =~ ^[0-9]+$ ]] || die "--retries must be a whole number, got '$retries'"
[[ $mode == start || $retries -eq 0 ]] || die "--retries supervises a launch; not with --$mode"
[[ -z $recreate$setup || ($retries -gt 0 && -n $tpu) ]] || die "--recreate and --setup go with --retries N and --tpu NAME"
[[ -z $setup || -n $recreate ]] || die "--setup runs on the hosts of a recreated TPU: give --recreate CMD too"
[[ $mode == start || ${#main_args[@]} -eq 0 ]] || die "--$mode takes no arguments for main.py"
[[ $megascale_port =~ ^[1-9][0-9]*$ ]] || die "--megascale-port must be a port number, got '$megascale_port'"
tpus=()     # --tpu NAME1,NAME2,...: slice S is tpus[S]
if [[ -n $tpu ]]; then
  [[ $tpu =~ ^[^,[:space:]]+(,[^,[:space:]]+)*$ ]] || die "--tpu takes NAME or NAME1,NAME2,... (no empty names), got '$tpu'"
  IFS=, read -ra tpus <<< "$tpu"
  declare -A named=()
  for t in "${tpus[@]}"; do [[ -z ${named[$t]:-} ]] || die "--tpu names TPU '$t' twice"; named[$t]=1; done
fi

# check_one_type TPU...: die unless the TPUs are of one accelerator type, naming each TPU and its type:
# one program runs on every slice, so every slice must have the same devices and the same workers
check_one_type() {
  local t type first="" list="" differ=0
  for t in "$@"; do
    type=$(gcloud compute tpus tpu-vm describe "$t" --zone "$zone" ${project:+--project "$project"} \
           --format='value(acceleratorType)') || die "gcloud could not describe TPU '$t' in zone '$zone'"
    list+="${list:+, }'$t' is ${type:-of no type}"
    [[ -z $first || $type == "$first" ]] || differ=1
    first=${first:-$type}
  done
  ((!differ)) || die "the TPUs of one run must be of one type: $list"
}

# resolve_slices TPU...: set `hosts` to the workers of the TPUs in order (slice 0's, then slice 1's, ...),
# so that host I is jax process I, and host_tpu, host_worker, host_slice to how each host is reached
resolve_slices() {
  local names=("$@") t i s all=() workers=()
  host_tpu=() host_worker=() host_slice=()
  for s in "${!names[@]}"; do
    t=${names[s]}
    resolve_hosts "$hosts_file" "$t" "$zone" "$project"
    for i in "${!hosts[@]}"; do host_tpu+=("$t") host_worker+=("$i") host_slice+=("$s"); done
    all+=("${hosts[@]}") workers+=("${#hosts[@]}")
  done
  hosts=("${all[@]}")
  (($# == 1)) || check_one_type "$@"
  for s in "${!names[@]}"; do
    ((workers[s] == workers[0])) || die "TPU '${names[s]}' reports ${workers[s]} workers, TPU '$1'" \
                                        "${workers[0]}: the slices of one run need as many each"
  done
}

# n_slices_in_args: main.py's --n_slices must be the number of TPUs: given it when missing (several
# TPUs), a usage error when it differs. Another program (--main) keeps its own arguments.
n_slices_in_args() {
  local given="" n_tpus=${#tpus[@]}
  [[ $mode == start && $n_tpus -gt 0 && $(basename "$main") == main.py ]] || return 0
  given=$(arg_value --n_slices ${main_args[@]+"${main_args[@]}"}) || true
  if [[ -z $given ]]; then
    ((n_tpus == 1)) || main_args+=(--n_slices "$n_tpus")
  elif [[ ! $given =~ ^[0-9]+$ ]] || ((10#$given != n_tpus)); then
    die "main.py's --n_slices $given differs from the $n_tpus TPU(s) of --tpu $tpu (one slice per TPU)"
  fi
}

n_slices_in_args
if ((${#tpus[@]})); then resolve_slices "${tpus[@]}"; else resolve_hosts "$hosts_file" "" "$zone" "$project"; fi
run_name_from_args ${main_args[@]+"${main_args[@]}"}   # --name, else main.py's --name, else jaxformer
n=${#hosts[@]}
# several TPUs: jax.distributed spans every slice, its coordinator on slice 0's worker 0 (8476: jax's port);
# a single TPU's workers find theirs themselves
if ((${#tpus[@]} > 1)) && [[ -z $coordinator ]]; then coordinator=${hosts[0]}:8476; fi
if [[ $mode == start && $n -gt 1 && -z $coordinator && -z $tpu ]]; then
  die "$n hosts and no --coordinator: off a TPU pod each host would start its own independent run;" \
      "give --coordinator FIRST_HOST:PORT (or --coordinator auto for TPU pod workers, or --tpu NAME)"
fi
[[ -z $coordinator || $coordinator == auto || $coordinator =~ ^[^:[:space:]]+:[0-9]+$ ]] ||
  die "--coordinator must be HOST:PORT or auto, got '$coordinator'"
[[ -z $coordinator || $coordinator == auto ]] || pass+=(--coordinator "$coordinator")
local_logs=${local_logs:-logs/launch/$name}
host_log() { echo "$local_logs/$1-${hosts[$1]//\//_}.log"; }

run_args() {  # the run.sh command line for host index $1 (with --tpu: its TPU and worker), then extra run.sh options
  local i=$1 reach=(); shift
  [[ -z ${host_tpu[i]:-} ]] ||
    reach=(--tpu "${host_tpu[i]}" --zone "$zone" ${project:+--project "$project"} --worker "${host_worker[i]}")
  printf '%s\0' "$here/run.sh" "${hosts[i]}" --name "$name" --index "$i" --num-processes "$n" \
    ${where[@]+"${where[@]}"} ${reach[@]+"${reach[@]}"} "$@"
}

# start_args I [OPTION...]: run_args to start host I's program. Over several TPUs, its MEGASCALE_*
# variables (the slices' link over the data-center network), computed here at each launch from the
# TPUs' IPs now: values kept on a host would be stale after a slice is recreated and hang jax.distributed.
start_args() {
  local i=$1 env=(); shift
  if ((${#tpus[@]} > 1)); then
    env=(--env "MEGASCALE_COORDINATOR_ADDRESS=${hosts[0]}:$megascale_port" --env "MEGASCALE_PORT=$megascale_port"
         --env "MEGASCALE_NUM_SLICES=${#tpus[@]}" --env "MEGASCALE_SLICE_ID=${host_slice[i]}")
  fi
  run_args "$i" ${env[@]+"${env[@]}"} ${pass[@]+"${pass[@]}"} "$@" -- ${main_args[@]+"${main_args[@]}"}
}

# on_what: "N host(s)", and over several TPUs which slices they are
on_what() {
  echo "$n host(s)$( ((${#tpus[@]} < 2)) || echo " of ${#tpus[@]} TPU slices (${tpus[*]})")"
}

# on_hosts OPTION...: run.sh --index I OPTION... at once for every host I not in `skip` (or, with
# `only` set, for the indices in it); print "host I HOST: " and its last output line each (with
# whole=1, all of it, indented); return 1 if any failed
declare -A skip=()
whole=0 only=()
on_hosts() {
  local i rc=0 tmp pids=()
  tmp=$(mktemp -d)
  for i in "${only[@]:-${!hosts[@]}}"; do
    [[ -z ${skip[$i]:-} ]] || continue
    mapfile -d '' cmd < <(run_args "$i" "$@")
    "${cmd[@]}" < /dev/null > "$tmp/$i" 2>&1 & pids[i]=$!
  done
  for i in "${!pids[@]}"; do
    wait "${pids[i]}" || rc=1
    if ((whole)); then
      echo "host $i ${hosts[i]}: $(sed '2,$s/^/    /' "$tmp/$i")"
    else
      echo "host $i ${hosts[i]}: $(tail -n 1 "$tmp/$i")"
    fi
  done
  rm -f "$tmp"/*; rmdir "$tmp"
  return "$rc"
}

# last_step: the last "step N |" line main.py printed in any host's log of the last attempt
last_step() {
  cat "$local_logs"/*.log 2>/dev/null | sed -n 's/^step  *\([0-9][0-9]*\) |.*/\1/p' | tail -n 1
}

# tpu_state TPU: its state (gcloud): READY, PREEMPTED, ..., GONE when it does not exist, or UNKNOWN (why)
tpu_state() {
  local state
  if ! state=$(gcloud compute tpus tpu-vm describe "$1" --zone "$zone" ${project:+--project "$project"} \
               --format='value(state)' 2>&1); then
    if [[ $state == *NOT_FOUND* ]]; then state=GONE; else state="UNKNOWN (gcloud failed: ${state//$'\n'/ })"; fi
  fi
  echo "$state"
}

# poll_tpu TPU: look at the TPU once. 0: READY (and its hosts set up, when it was recreated); 1: not yet
# (a TPU preempted, terminated or gone is recreated once, by --recreate with TPU_NAME=TPU); 2: --recreate
# or --setup failed. recreated and seen (its state when last shown) persist over the polls.
declare -A recreated=() seen=()
poll_tpu() {
  local t=$1 state rc=0 output
  state=$(tpu_state "$t")
  if [[ $state == READY ]]; then
    echo "launcher.sh: TPU '$t' is READY"
    [[ -z ${recreated[$t]:-} || -z $setup ]] || set_up_hosts "$t" || return 2
    return 0
  fi
  if [[ $state =~ ^(PREEMPTED|TERMINATED|GONE)$ && -n $recreate && -z ${recreated[$t]:-} ]]; then
    echo "launcher.sh: TPU '$t' is $state; recreating it (--recreate): $recreate"
    output=$(TPU_NAME=$t bash -c "$recreate" 2>&1) || rc=$?
    [[ -z $output ]] || echo "    ${output//$'\n'/$'\n'    }"
    ((rc == 0)) || { echo "launcher.sh: error: --recreate failed (exit $rc); not retried" >&2; return 2; }
    recreated[$t]=1 seen[$t]=""
    poll_tpu "$t"; return        # at once: a CMD that waits for the creation leaves it READY
  fi
  if [[ $state != "${seen[$t]:-}" ]]; then
    echo "launcher.sh: TPU '$t' is $state; waiting for READY (every ${LAUNCHER_POLL_S:-30} s)"
    [[ ! $state =~ ^(PREEMPTED|TERMINATED|GONE)$ || -n $recreate ]] ||
      echo "launcher.sh: a $state TPU VM does not come back by itself: delete and create it (or its queued" \
           "resource) again, by hand or with --recreate CMD"
  fi
  seen[$t]=$state
  return 1
}

# wait_for_tpus: with --tpu, poll every TPU until all are READY (poll_tpu): a run over several slices
# needs all of them, so the ones preempted are recreated while the others wait
wait_for_tpus() {
  local t rc pending=(${tpus[@]+"${tpus[@]}"}) waiting
  recreated=() seen=()
  while ((${#pending[@]})); do
    waiting=()
    for t in "${pending[@]}"; do
      rc=0; poll_tpu "$t" || rc=$?
      ((rc != 2)) || return 1
      ((rc == 0)) || waiting+=("$t")
    done
    pending=(${waiting[@]+"${waiting[@]}"})
    ((${#pending[@]} == 0)) || sleep "${LAUNCHER_POLL_S:-30}"
  done
}

# set_up_hosts TPU: --setup on every host of the recreated TPU (its workers may be new machines)
set_up_hosts() {
  resolve_slices "$1"
  echo "launcher.sh: setting up the ${#hosts[@]} host(s) of the new TPU (--setup): $setup"
  whole=1
  if ! on_hosts --setup "$setup" | sed 's/^/    /'; then
    echo "launcher.sh: error: --setup failed on a host (above)" >&2; return 1
  fi
}

# supervise: launch with --wait until the run finishes; relaunch after an abnormal end (see --help)
supervise() {
  local attempt=0 rc cause step previous=""
  out=$(mktemp)
  trap 'rm -f "$out"' EXIT     # out is global: the trap runs after this returns, when the launcher exits
  while :; do
    rc=0
    "$here/launcher.sh" "${supervised[@]}" 2>&1 | tee "$out" || rc=${PIPESTATUS[0]}
    if ((rc == 0)); then echo "launcher.sh: run '$name' finished (attempts: $((attempt + 1)))"; return 0; fi
    cause=$(grep -o 'host [0-9]* [^ ]*: HUNG, [^;]*' "$out" | head -n 1 || true)
    cause=${cause:-$(grep -o 'host [0-9]* [^ ]*: FAILED, [^;]*' "$out" | head -n 1 || true)}
    cause=${cause:-launcher exit status $rc} step=$(last_step)
    if ((rc == 2)); then
      echo "launcher.sh: error: usage error (exit 2): not retried" >&2; return 2
    elif [[ "$cause at step ${step:-none}" == "$previous" ]]; then
      echo "launcher.sh: error: the run failed the same way twice ($cause at step ${step:-none}): a bug," \
           "not a preemption; not retried" >&2; return 1
    elif ((attempt >= retries)); then
      echo "launcher.sh: error: $cause at step ${step:-none}; no retries left (--retries $retries)" >&2
      return 1
    fi
    previous="$cause at step ${step:-none}" attempt=$((attempt + 1))
    echo "launcher.sh: retry $attempt of $retries after: $previous"
    wait_for_tpus || return 1
  done
}

if ((retries)); then
  skip_next=0
  for a in "${args[@]}"; do      # the same command line without --retries N, waiting, replacing sessions
    if ((skip_next)); then skip_next=0; continue; fi
    if [[ $a =~ ^--(retries|recreate|setup)$ ]]; then skip_next=1; continue; fi
    if [[ $a == -- ]]; then break; fi
    supervised+=("$a")
  done
  supervised+=(--wait --force -- ${main_args[@]+"${main_args[@]}"})
  supervise; exit
fi

if ((dry_run)); then
  echo "# launcher.sh --dry-run: run '$name' on $(on_what): ${hosts[*]}"
  for i in "${!hosts[@]}"; do
    mapfile -d '' cmd < <(start_args "$i")
    echo "## host $i: ${hosts[i]}$( ((${#tpus[@]} < 2)) ||
      echo " (TPU ${host_tpu[i]} worker ${host_worker[i]}, slice ${host_slice[i]})")"
    "${cmd[@]:0:1}" --dry-run "${cmd[@]:1}"
  done
  exit 0
fi

case $mode in
  status) echo "launcher.sh: run '$name' on $(on_what)"; whole=1; on_hosts --status; exit ;;
  stacks) echo "launcher.sh: the newest thread stacks of run '$name' on $(on_what)"; whole=1; on_hosts --stacks; exit ;;
  stop) echo "launcher.sh: stopping run '$name' on $(on_what) (SIGTERM: main.py saves a checkpoint and exits)"
        if on_hosts --stop --timeout "$timeout"; then exit 0; fi
        echo "launcher.sh: error: the run did not end on every host within $timeout s (--timeout)" >&2; exit 1 ;;
esac

if ((wait)); then until=(--wait); else until=(--ready --timeout "$timeout"); fi
mkdir -p "$local_logs"
declare -A index_of
pid_of=()
for i in "${!hosts[@]}"; do
  mapfile -d '' cmd < <(start_args "$i" "${until[@]}")
  "${cmd[@]}" < /dev/null > "$(host_log "$i")" 2>&1 &
  index_of[$!]=$i pid_of[i]=$!
done
echo "launcher.sh: run '$name' on $(on_what), logs in $local_logs/; waiting for every host to" \
     "$( ((wait)) && echo "finish" || echo "pass start-up (up to $timeout s)")"

# stop_all: stop the run on every host that has not failed, once each host's run.sh has started its
# tmux session or ended (a session started after the stop would be left running). Once a host has failed,
# no step or save can finish (each needs every process), so a SIGTERM gets 5 s before the SIGKILL.
stop_all() {
  local i
  for i in "${!hosts[@]}"; do
    while kill -0 "${pid_of[i]}" 2>/dev/null && ! grep -q '^run.sh: started tmux session' "$(host_log "$i")"; do
      sleep 0.5
    done
  done
  echo "launcher.sh: stopping the run on the other host(s) (--keep-going leaves them running):" >&2
  on_hosts --stop --force --timeout 5 | sed 's/^/    /' >&2 || true
}

# name_hung: after host $1's watchdog ended it (exit 3), wait for the other hosts' watchdogs; a host
# whose program is still running after LAUNCHER_HANG_GRACE_S is the one the others waited on: HUNG
name_hung() {
  local i end=$((SECONDS + ${LAUNCHER_HANG_GRACE_S:-30})) running=()
  echo "launcher.sh: host $1 ${hosts[$1]}'s hang watchdog ended it; waiting up to ${LAUNCHER_HANG_GRACE_S:-30} s" \
       "for the other hosts' watchdogs to find the host that stopped" >&2
  while :; do
    running=()
    for i in "${!hosts[@]}"; do
      [[ -n ${skip[$i]:-} ]] || ! kill -0 "${pid_of[i]}" 2>/dev/null || running+=("$i")
    done
    ((${#running[@]} && SECONDS < end)) || break
    sleep 1
  done
  ((${#running[@]})) || return 0
  only=("${running[@]}") whole=0
  on_hosts --stacks | while read -r _ i host why; do
    echo "launcher.sh: host $i ${host%:}: HUNG, its program did not end by its own watchdog as host $1's did" \
         "(run.sh --stacks: ${why})" >&2
  done || true
  only=()
}

# report each host as its run.sh ends; on the first failure stop the others, unless --keep-going
failed=() stopped=0
for _ in "${!hosts[@]}"; do
  rc=0; wait -n -p pid || rc=$?
  i=${index_of[$pid]}
  if ((stopped)); then
    echo "launcher.sh: host $i ${hosts[i]}: stopped"; continue
  elif ((rc == 0)); then
    echo "launcher.sh: host $i ${hosts[i]}: ok$( ((wait)) && echo ", finished" || echo ", main.py passed start-up")"
    continue
  fi
  hang=""     # main.py's watchdog line (exit 3), which says what the program waited on; its stacks follow it
  ((rc != 3)) || hang=$(grep -a 'made no progress' "$(host_log "$i")" | tail -n 1 || true)
  case $rc in
    255) why="unreachable over SSH (exit 255)" ;;
    8) why="no start-up within $timeout s (--timeout)" ;;
    *) why="exit status $rc" ;;
  esac
  if [[ -n $hang ]]; then
    echo "launcher.sh: host $i ${hosts[i]}: FAILED, $why (its hang watchdog: no progress for --hang_timeout s);" \
         "its stacks are in $(host_log "$i") after:" >&2
    echo "    $hang" >&2
  else                          # the last lines but gloo's start-up chatter (a line per peer, interleaved)
    echo "launcher.sh: host $i ${hosts[i]}: FAILED, $why; last lines of $(host_log "$i"):" >&2
    grep -a -v 'peer ranks' "$(host_log "$i")" | tail -n 12 | sed 's/^/    /' >&2
  fi
  failed[i]=${hosts[i]}          # reported in host order
  ((rc == 8)) || skip[$i]=1     # a host that timed out is still running: stop it too
  if [[ -n $hang ]] && ((!keep_going && n > ${#skip[@]})); then name_hung "$i"; fi
  if ((!keep_going && n > ${#skip[@]})); then stop_all; stopped=1; fi
done
if ((${#failed[@]})); then
  echo "launcher.sh: error: ${#failed[@]} of $n host(s) failed: ${failed[*]}" >&2
  exit 1
fi
echo "launcher.sh: run '$name' is $( ((wait)) && echo "done" || echo "running") on $n host(s);" \
     "see it: launcher.sh --status $name ...; stop it: launcher.sh --stop $name ... (same hosts)"
