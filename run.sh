#!/usr/bin/env bash
# run.sh: start one process of a JAXformer run on HOST, inside a tmux session, over SSH.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: run.sh HOST [options] [-- MAIN_ARGS...]

Over SSH, start `python main.py MAIN_ARGS` on HOST inside a detached tmux session named after the
run (so it survives a dropped link), in the checkout, with its output teed to a log on the host.
With --status or --stop, report on or stop that run instead.

options:
  --name RUN             run name: tmux session RUN (RUN-I with --index I), log RUN[-I].log, and
                         main.py's --name (default: the value of --name in MAIN_ARGS, else
                         "jaxformer"; a different --name in MAIN_ARGS is an error)
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
  --tpu NAME --zone Z    reach the host with `gcloud compute tpus tpu-vm ssh NAME --worker W`
  --worker W             with --tpu: the host's worker number in TPU NAME (default: --index; they
                         differ when a run spans several TPUs: launcher.sh --tpu NAME1,NAME2)
  --project P            gcloud project for --tpu
  --force                kill an existing tmux session of the same name, and its program, first
  --wait                 stay connected until the program ends; stream its log; exit with its status
  --ready                wait until main.py has passed start-up (its line "jaxformer started:
                         process I of N, ..."; up to --timeout), or exit with the status of a
                         program that ended first, showing the last lines of its log
  --status               print: session running or not, the program's newest step and how long
                         ago it was ("no step for N min"), what it is doing, the last step and loss
                         in the log and how long ago the log changed; then its goodput so far (from
                         the heartbeat file main.py writes next to the log: --heartbeat_file)
  --setup CMD            run CMD on HOST with bash in its home directory (no checkout needed: a new
                         host, e.g. "git clone URL JAXformer; cd JAXformer && ./setup_tpu.sh"), stream
                         its output and exit with its status
  --stacks               print the program's newest thread stacks: a running program gets SIGUSR1
                         (main.py writes every thread's stack to its log, and goes on) and its dump
                         is shown, or why none came (a stopped program cannot answer); a program
                         that ended: the newest dump in its log (the hang watchdog's)
  --stop                 send SIGTERM to the program (main.py checkpoints and exits) and wait up to
                         --timeout for its session to end; with --force, then kill the program
                         and the session
  --timeout S            seconds for --ready and --stop (default 900)
  --dry-run              print what would run, run nothing
  -h, --help             this help

environment:
  SSH                    SSH command (default "ssh -o BatchMode=yes -o ConnectTimeout=15"); it is
                         called as `$SSH HOST COMMAND`, so tests can substitute a local runner
  WANDB_API_KEY, HF_TOKEN  secrets: sent to the host on stdin into a private file that the run
                         reads and deletes; never on a command line, in a pane, a log or --dry-run
  RUN_STACKS_WAIT_S      --stacks: seconds to wait for the program's dump (default 10)

exit status: 0 started (with --ready: passed start-up; --wait: finished) OK, or stopped; 2 bad
usage; 255 HOST unreachable; 3 no checkout; 4 tmux missing on HOST; 5 local changes block --commit;
6 git failed; 7 session exists; 8 --ready timed out; 9 --stop timed out; otherwise the program's
exit status (--wait, or --ready when it ended before start-up).
EOF
}

die() { echo "run.sh: error: $*" >&2; exit 2; }
# shellcheck source-path=SCRIPTDIR source=launch_lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/launch_lib.sh"   # value, run_name_from_args, q, sq

host="" name="" index="" worker="" nproc="" coordinator="" dir="${JAXFORMER_DIR:-}" commit="asis"
python="" main="main.py" log_dir="" tpu="" zone="" project="" force=0 wait=0 dry_run=0
mode=start ready=0 timeout=900 extra_env=() main_args=() setup_cmd=""

while (($#)); do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --name) name=$(value "$@"); shift 2 ;;
    --index) index=$(value "$@"); shift 2 ;;
    --worker) worker=$(value "$@"); shift 2 ;;
    --num-processes) nproc=$(value "$@"); shift 2 ;;
    --coordinator) coordinator=$(value "$@"); shift 2 ;;
    --dir) dir=$(value "$@"); shift 2 ;;
    --commit) commit=$(value "$@"); shift 2 ;;
    --python) python=$(value "$@"); shift 2 ;;
    --main) main=$(value "$@"); shift 2 ;;
    --log-dir) log_dir=$(value "$@"); shift 2 ;;
    --env) extra_env+=("$(value "$@")"); shift 2 ;;
    --tpu) tpu=$(value "$@"); shift 2 ;;
    --zone) zone=$(value "$@"); shift 2 ;;
    --project) project=$(value "$@"); shift 2 ;;
    --timeout) timeout=$(value "$@"); shift 2 ;;
    --ready) ready=1; shift ;;
    --status) mode=status; shift ;;
    --stacks) mode=stacks; shift ;;
    --setup) mode=setup; setup_cmd=$(value "$@"); shift 2 ;;
    --stop) mode=stop; shift ;;
    --force) force=1; shift ;;
    --wait) wait=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; main_args=("$@"); break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [[ -z $host ]] || die "one HOST only (got '$host' and '$1'); arguments for main.py go after --"
       host=$1; shift ;;
  esac
done

[[ -n $host ]] || die "missing HOST (see --help)"
[[ $timeout =~ ^[1-9][0-9]*$ ]] || die "--timeout must be a positive number of seconds, got '$timeout'"
[[ -z $index || $index =~ ^[0-9]+$ ]] || die "--index must be a non-negative integer, got '$index'"
[[ -z $worker || $worker =~ ^[0-9]+$ ]] || die "--worker must be a non-negative integer, got '$worker'"
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
# main.py gets the run's name too, so its run directory is OUTPUT_DIR/RUN (another program: untouched)
[[ $(basename "$main") != main.py || -n $name_in_args ]] || main_args+=(--name "$name")
session=${name//./_}${index:+-$index}          # tmux forbids '.' and ':' in session names
[[ -n $dir ]] || dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log_dir=${log_dir:-$dir/logs}
log=$log_dir/$session.log
status_file=$log_dir/$session.exit
pid_file=$log_dir/$session.pid    # the program's pid, for --stop and --stacks
heartbeat=$log_dir/$session.heartbeat   # main.py's progress (multihost.Watchdog), for --status
[[ $(basename "$main") != main.py ]] || main_args+=(--heartbeat_file "$heartbeat")
# what main.py prints on every process once its first training step is dispatched (main.py: started_line)
ready_line='jaxformer started: process '   # anywhere in a line: a progress bar may precede it

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
# the program replaces a subshell that first writes its pid: --stop signals exactly the program; the tee
# ignores SIGHUP, so that when the pane closes the log still gets what the program prints while it saves
inner+="; { echo \$BASHPID > $(q "$pid_file"); exec $cmd; } 2>&1 | { trap '' HUP; exec tee -a $(q "$log"); }"
inner+="; code=\${PIPESTATUS[0]}"
inner+="; rm -f $(q "$pid_file"); echo \"run.sh: exit status \$code\" | tee -a $(q "$log"); echo \$code > $(q "$status_file")"

# ---- the command sent over SSH: checks, then start (optional checkout, tmux session, optional
# wait), --status or --stop ----
S=$(q "=$session") LOG=$(q "$log") STATUS=$(q "$status_file") H=$(q "$host") HB=$(q "$heartbeat")
preamble=$(cat <<EOF
set -euo pipefail
secrets=""
fail() { rm -f "\$secrets"; echo "run.sh: error on $H: \$2" >&2; exit "\$1"; }
# kill_program: SIGKILL the program of the pid file, if alive, and wait for it to go. Killing the tmux
# session alone is not enough: main.py takes SIGHUP as a stop, and one stuck in a collective stays.
kill_program() {
  local p; p=\$(cat $(q "$pid_file") 2>/dev/null || true)
  if [ -n "\$p" ] && kill -KILL "\$p" 2>/dev/null; then
    for _ in \$(seq 50); do kill -0 "\$p" 2>/dev/null || break; sleep 0.2; done
    echo "SIGKILL to pid \$p; "
  fi
  rm -f $(q "$pid_file")
}
cd $(q "$dir") 2>/dev/null || fail 3 $(q "no checkout at $dir (clone the repo there or pass --dir)")
command -v tmux >/dev/null || fail 4 "tmux is not installed (sudo apt-get install -y tmux)"
EOF
)
start=$(cat <<EOF
secrets=\$(umask 077 && mktemp "\${TMPDIR:-/tmp}/jaxformer-env.XXXXXX"); cat > "\$secrets"
if [ $(q "$commit") != asis ]; then
  [ -z "\$(git status --porcelain --untracked-files=no)" ] || fail 5 $(q "the checkout $dir has local changes; commit or stash them there, or run with --commit asis")
  git cat-file -e $(q "$commit^{commit}") 2>/dev/null || git fetch --quiet || fail 6 "git fetch failed"
  git checkout --quiet --detach $(q "$commit") || fail 6 $(q "git checkout $commit failed")
fi
if tmux has-session -t $S 2>/dev/null; then
  [ $force = 1 ] || [ -s $STATUS ] || fail 7 $(q "tmux session '$session' is already running (attach: tmux attach -t $session; replace: --force)")
  kill_program >/dev/null; tmux kill-session -t $S 2>/dev/null || true     # gone with its program, maybe
elif [ $force = 1 ]; then
  kill_program >/dev/null      # a program that outlived its session (a killed pane or tmux server)
fi
mkdir -p $(q "$log_dir"); rm -f $STATUS $HB    # no status or heartbeat of an earlier session
offset=0; [ -f $LOG ] && offset=\$(wc -c < $LOG)   # the log is appended to: --ready reads past this
tmux new-session -d -s $(q "$session") -x 200 -y 50 bash -c $(sq "$inner") run.sh "\$secrets"
echo "run.sh: started tmux session '$session' on $H (tmux attach -t $session), log $LOG"
if [ $wait = 1 ]; then
  # The program has ended when its exit status is written (the pane's last act): not when the pane's
  # process is gone, which tmux may leave unreaped (a zombie, "alive" to tail --pid) and the session up.
  tail -n +1 -F $LOG 2>/dev/null & tail_pid=\$!
  while [ ! -s $STATUS ] && tmux has-session -t $S 2>/dev/null; do sleep 1; done
  sleep 1; kill \$tail_pid 2>/dev/null || true
  [ -s $STATUS ] || fail 1 "the run ended without an exit status (see $LOG)"
  exit "\$(cat $STATUS)"
fi
if [ $ready = 1 ]; then
  end=\$((SECONDS + $timeout))
  while ! tail -c +\$((offset + 1)) $LOG 2>/dev/null | grep -q -a $(q "$ready_line"); do
    if [ -s $STATUS ] || ! tmux has-session -t $S 2>/dev/null; then
      code=\$(cat $STATUS 2>/dev/null || echo 1)
      if [ "\$code" = 0 ]; then echo "run.sh: the program on $H finished (exit status 0)"; exit 0; fi
      echo "run.sh: last lines of $LOG on $H:"
      tail -c +\$((offset + 1)) $LOG | tail -n 10 | sed 's/^/    /'
      fail "\$code" "the program exited with status \$code before start-up"
    fi
    [ \$SECONDS -lt \$end ] || fail 8 $(q "no start-up line from the program within $timeout s; it is still running in tmux session '$session' (see $log)")
    sleep 1
  done
  echo "run.sh: the program on $H passed start-up"
fi
EOF
)
no_step="no step logged"; [[ ${index:-0} == 0 ]] || no_step+=" (process 0 logs the steps)"
status=$(cat <<EOF
ago() { if [ \$1 -lt 120 ]; then echo "\$1 s"; elif [ \$1 -lt 7200 ]; then echo "\$((\$1 / 60)) min"; else echo "\$((\$1 / 3600)) h"; fi; }
if [ -s $STATUS ]; then state="ended, exit status \$(cat $STATUS)"
elif tmux has-session -t $S 2>/dev/null; then state=running
else state=$(q "not running (no tmux session '$session')"); fi
progress=""; goodput=""
if [ -f $HB ]; then
  beat() { sed -n "s/^\$1 //p" $HB | head -n 1; }
  step_time=\$(beat step_time)
  if [ -n "\$step_time" ]; then progress="step \$(beat step), no step for \$(ago \$((\$(date +%s) - \${step_time%.*}))) (\$(beat doing)) | "
  else progress="no step yet (\$(beat doing)) | "; fi
  for line in "\$(beat goodput)" "\$(beat run_goodput)"; do [ -z "\$line" ] || goodput="\$goodput
    \$line"; done
fi
if [ -f $LOG ]; then
  last=\$(tr '\r' '\n' < $LOG | grep -a -o -E 'step +[0-9]+ \| loss [^ |]+' | tail -n 1 | tr -s ' ' || true)
  tag=""; [ -z "\$progress" ] || [ -z "\$last" ] || tag="logged: "
  echo "\$state | \$progress\$tag\${last:-$no_step} | log changed \$(ago \$((\$(date +%s) - \$(stat -c %Y $LOG)))) ago\$goodput"
else
  echo "\$state | \${progress}no log at $LOG"
fi
EOF
)
# a thread header of faulthandler's dump (Python's faulthandler.c)
stack_header='^(Current thread|Thread) 0x[0-9a-f]+ '
stacks=$(cat <<EOF
pid=\$(cat $(q "$pid_file") 2>/dev/null || true)
headers() { grep -a -c -E $(q "$stack_header") $LOG 2>/dev/null || true; }
if [ -n "\$pid" ] && kill -0 "\$pid" 2>/dev/null; then
  before=\$(headers); kill -USR1 "\$pid"; end=\$((SECONDS + ${RUN_STACKS_WAIT_S:-10}))
  while [ "\$(headers)" = "\$before" ]; do
    if [ \$SECONDS -ge \$end ]; then
      case \$(ps -o state= -p "\$pid" 2>/dev/null | tr -d ' ') in
        T*|t*) why="it is stopped (process state T: SIGSTOP, a debugger, a suspended job)" ;;
        D*) why="it is in uninterruptible sleep (process state D: waiting on a disk or a device)" ;;
        "") why="it has ended" ;;
        *) why="no thread of it could run Python (stuck in native code holding the interpreter lock?)" ;;
      esac
      echo "no stacks: pid \$pid did not answer SIGUSR1 within ${RUN_STACKS_WAIT_S:-10} s; \$why"; exit 0
    fi
    sleep 0.5
  done
  sleep 1                                   # the dump is written in one go; let it finish
  echo "stacks of pid \$pid (SIGUSR1), from $LOG:"
else
  echo "the program is not running; the newest stack dump in $LOG:"
fi
# the newest dump: a thread header and the File lines, blank lines and headers after it, with the
# watchdog's line when it precedes the dump
[ -f $LOG ] || { echo "(no log)"; exit 0; }
awk -v header=$(q "$stack_header") '
  \$0 ~ header && !inside { inside = 1; dump = (previous ~ /made no progress/ ? previous "\n" : "") }
  inside && (\$0 ~ header || /^  File "/ || /^  </ || /^\$/) { dump = dump \$0 "\n"; previous = \$0; next }
  inside { inside = 0; newest = dump }
  { previous = \$0 }
  END { if (inside) newest = dump; if (newest == "") print "(no stack dump in the log)"; else printf "%s", newest }
' $LOG
EOF
)
stop=$(cat <<EOF
if ! tmux has-session -t $S 2>/dev/null; then echo $(q "not running (no tmux session '$session')"); exit 0; fi
pid=\$(cat $(q "$pid_file") 2>/dev/null || true)
if [ -n "\$pid" ] && kill -TERM "\$pid" 2>/dev/null; then how="SIGTERM to pid \$pid"; else how="no program pid"; fi
end=\$((SECONDS + $timeout))
while [ ! -s $STATUS ] && tmux has-session -t $S 2>/dev/null; do
  if [ \$SECONDS -ge \$end ]; then
    [ $force = 1 ] || fail 9 $(q "tmux session '$session' still running $timeout s after SIGTERM (tmux attach -t $session)")
    killed=\$(kill_program); tmux kill-session -t $S 2>/dev/null || true; echo "\$how; \${killed}killed tmux session '$session' after $timeout s"; exit 0
  fi
  sleep 1
done
echo "\$how; session '$session' ended, exit status \$(cat $STATUS 2>/dev/null || echo unknown)"
EOF
)
case $mode in start) body=$start ;; status) body=$status ;; stop) body=$stop ;; stacks) body=$stacks ;; esac
if [[ $mode == setup ]]; then remote="cd && { $setup_cmd
}; code=\$?; echo \"run.sh: --setup on $(q "$host") exited \$code\"; exit \$code"; else remote="$preamble"$'\n'"$body"; fi

if [[ -n ${SSH:-} ]]; then
  read -ra ssh_cmd <<< "$SSH"; ssh_cmd+=("$host")
elif [[ -n $tpu ]]; then
  worker=${worker:-$index}
  [[ -n $worker ]] || die "--tpu needs --index (the TPU worker) or --worker"
  ssh_cmd=(gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" ${project:+--project "$project"} --worker "$worker" --command)
else
  ssh_cmd=(ssh -o BatchMode=yes -o ConnectTimeout=15 "$host")
fi

secret_names=()   # sent only to start a run
for var in WANDB_API_KEY HF_TOKEN; do [[ $mode == start && -n ${!var:-} ]] && secret_names+=("$var"); done
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
