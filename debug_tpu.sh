#!/usr/bin/env bash
# debug_tpu.sh: a local tmux session with one pane per host running the same command, plus monitors.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: debug_tpu.sh (--hosts FILE | --tpu NAME --zone ZONE [--project P]) [options] [-- COMMAND...]

Opens a local tmux session: window "run" has one pane per host (tiled), each running COMMAND on its
host over SSH in DIR (default COMMAND: an interactive shell); window "monitor" has one pane per host
running the first of tpu-info, nvidia-smi, top that the host has. Panes stay open after COMMAND ends.

options:
  --session NAME         tmux session name (default: jaxformer-debug)
  --dir DIR              directory on the hosts to run COMMAND in (default: $JAXFORMER_DIR, else this
                         script's directory)
  --force                replace an existing session of that name
  --no-attach            create the session but do not attach (default when stdout is not a terminal)
  --kill                 kill the session and exit
  --dry-run              print the panes and their commands, run nothing
  -h, --help             this help

environment: SSH (default "ssh -t -o ConnectTimeout=15"; called as `$SSH HOST COMMAND`). No secret
is forwarded or typed into a pane: hosts use their own credentials (setup_tpu.sh --wandb-login).
EOF
}

die() { echo "debug_tpu.sh: error: $*" >&2; exit 2; }
# shellcheck source-path=SCRIPTDIR source=launch_lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/launch_lib.sh"   # value, resolve_hosts, q, sq

hosts_file="" tpu="" zone="" project="" session="jaxformer-debug" dir="${JAXFORMER_DIR:-}"
force=0 attach=1 kill=0 dry_run=0 command=()
while (($#)); do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --hosts) hosts_file=$(value "$@"); shift 2 ;;
    --tpu) tpu=$(value "$@"); shift 2 ;;
    --zone) zone=$(value "$@"); shift 2 ;;
    --project) project=$(value "$@"); shift 2 ;;
    --session) session=$(value "$@"); shift 2 ;;
    --dir) dir=$(value "$@"); shift 2 ;;
    --force) force=1; shift ;;
    --no-attach) attach=0; shift ;;
    --kill) kill=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; command=("$@"); break ;;
    *) die "unknown argument '$1' (see --help; the command goes after --)" ;;
  esac
done
[[ $session =~ ^[A-Za-z0-9_-]+$ ]] || die "--session may hold only letters, digits, '_', '-': '$session'"
((dry_run)) || command -v tmux >/dev/null || die "tmux is not installed here (sudo apt-get install -y tmux)"

if ((kill)); then
  tmux kill-session -t "=$session" 2>/dev/null || die "no tmux session '$session'"
  echo "debug_tpu.sh: killed tmux session '$session'"; exit 0
fi

resolve_hosts "$hosts_file" "$tpu" "$zone" "$project"
[[ -n $dir ]] || dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# the local command that runs $2 (a shell command) on host index $1
pane_cmd() {
  local remote
  if ((${#command[@]})) && [[ $2 == RUN ]]; then
    remote="cd $(q "$dir") && $(printf '%q ' "${command[@]}")"
  elif [[ $2 == RUN ]]; then
    remote="cd $(q "$dir") && exec bash -l"
  else
    remote='if command -v tpu-info >/dev/null; then while :; do clear; tpu-info; sleep 2; done;'
    remote+=' elif command -v nvidia-smi >/dev/null; then nvidia-smi -l 2; else top -d 2; fi'
  fi
  remote="bash -c $(sq "$remote")"
  if [[ -n ${SSH:-} ]]; then
    printf '%s %q %s' "$SSH" "${hosts[$1]}" "$(sq "$remote")"
  elif [[ -n $tpu ]]; then
    printf 'gcloud compute tpus tpu-vm ssh %q --zone %q %s--worker %d --command %s -- -t' \
      "$tpu" "$zone" "${project:+--project $(q "$project") }" "$1" "$(sq "$remote")"
  else
    printf 'ssh -t -o ConnectTimeout=15 %q %s' "${hosts[$1]}" "$(sq "$remote")"
  fi
  # keep the pane open when the command ends, so its last output and its own exit status can be read
  # shellcheck disable=SC2016  # $rc is the pane shell's
  printf '; rc=$?; echo; echo "[debug_tpu.sh: %s: exit status $rc]"; exec bash --norc -i' "${hosts[$1]}"
}

if ((dry_run)); then
  echo "# debug_tpu.sh --dry-run: tmux session '$session', ${#hosts[@]} host(s)"
  for w in RUN MONITOR; do
    for i in "${!hosts[@]}"; do echo "window ${w,,} pane $i (${hosts[i]}): $(pane_cmd "$i" "$w")"; done
  done
  exit 0
fi

if tmux has-session -t "=$session" 2>/dev/null; then
  ((force)) || die "tmux session '$session' already exists (attach: tmux attach -t $session; replace: --force)"
  tmux kill-session -t "=$session"
fi
tmux new-session -d -s "$session" -n run -c "$PWD" -x 240 -y 60 "$(pane_cmd 0 RUN)"
for ((i = 1; i < ${#hosts[@]}; i++)); do
  tmux split-window -t "=$session:run" -c "$PWD" "$(pane_cmd "$i" RUN)"
  tmux select-layout -t "=$session:run" tiled >/dev/null
done
tmux new-window -t "=$session" -n monitor -c "$PWD" "$(pane_cmd 0 MONITOR)"
for ((i = 1; i < ${#hosts[@]}; i++)); do
  tmux split-window -t "=$session:monitor" -c "$PWD" "$(pane_cmd "$i" MONITOR)"
  tmux select-layout -t "=$session:monitor" tiled >/dev/null
done
tmux select-window -t "=$session:run"
tmux set-option -w -t "=$session:run" synchronize-panes on >/dev/null  # typing goes to every host
echo "debug_tpu.sh: tmux session '$session': window 'run' (${#hosts[@]} panes, input synchronized), window 'monitor'"
if ((attach)) && [[ -t 1 ]]; then
  if [[ -n ${TMUX:-} ]]; then exec tmux switch-client -t "=$session"; else exec tmux attach -t "=$session"; fi
fi
echo "debug_tpu.sh: attach with: tmux attach -t $session; close with: debug_tpu.sh --kill --session $session"
