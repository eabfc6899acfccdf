#!/usr/bin/env bash
# Stand-in for ssh in the launch tests: `launch_local_ssh.sh [-t] HOST COMMAND...` runs COMMAND on
# this machine as a fresh login would: a clean environment (HOME, PATH, TERM, TMUX_TMPDIR only, so
# nothing leaks from the caller but what the scripts forward), stdin passed through.
# A HOST named unreachable* fails like ssh does for a dead host: a message and exit status 255.
# LOCAL_SSH_PATH, when set, is the "remote" PATH (e.g. one without tmux).
set -euo pipefail
while [[ ${1:-} == -* ]]; do shift; done          # ssh options such as -t
host=${1:?usage: launch_local_ssh.sh HOST COMMAND...}; shift
if [[ $host == unreachable* ]]; then
  echo "ssh: connect to host $host port 22: Connection refused" >&2
  exit 255
fi
echo "$host" >> "${LOCAL_SSH_TRACE:-/dev/null}"
exec env -i HOME="$HOME" PATH="${LOCAL_SSH_PATH:-$PATH}" ${TMUX_TMPDIR:+TMUX_TMPDIR="$TMUX_TMPDIR"} \
  ${TERM:+TERM="$TERM"} LANG=C.UTF-8 bash -c "$*"
