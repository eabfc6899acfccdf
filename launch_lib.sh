# shellcheck shell=bash
# launch_lib.sh: code shared by launcher.sh, debug_tpu.sh and run.sh, which source it from their own
# directory. Not run on its own. The caller defines die (print "SCRIPT: error: ...", exit 2) and,
# for resolve_hosts, usage; both are called from here so every message stays the caller's own.

# resolve_hosts HOSTS_FILE TPU ZONE PROJECT: set the global array `hosts` to the hosts named by
# --hosts HOSTS_FILE (one [user@]host a line; blank lines and # comments ignored) or, with TPU set,
# to the workers of that TPU VM (gcloud compute tpus tpu-vm describe). Dies on bad or missing input.
resolve_hosts() {
  local hosts_file=$1 tpu=$2 zone=$3 project=$4 line ips
  hosts=()
  if [[ -n $hosts_file ]]; then
    [[ -z $tpu ]] || die "give --hosts or --tpu, not both"
    [[ -f $hosts_file ]] || die "hosts file '$hosts_file' not found"
    while IFS= read -r line || [[ -n $line ]]; do
      line=${line%%#*}; read -r line _ <<< "$line" || true
      [[ -n $line ]] && hosts+=("$line")
    done < "$hosts_file"
    ((${#hosts[@]})) || die "hosts file '$hosts_file' lists no hosts"
  elif [[ -n $tpu ]]; then
    [[ -n $zone ]] || die "--tpu needs --zone"
    command -v gcloud >/dev/null || die "--tpu needs the gcloud CLI (https://cloud.google.com/sdk)"
    ips=$(gcloud compute tpus tpu-vm describe "$tpu" --zone "$zone" ${project:+--project "$project"} \
          --format='value(networkEndpoints[].ipAddress)') || die "gcloud could not describe TPU '$tpu' in zone '$zone'"
    read -ra hosts <<< "${ips//[;,]/ }"
    ((${#hosts[@]})) || die "TPU '$tpu' in zone '$zone' reports no workers"
  else
    usage >&2; die "missing --hosts FILE or --tpu NAME --zone ZONE"
  fi
}

# run_name_from_args [MAIN_ARGS...]: if the global `name` is empty, set it from main.py's own
# --name VALUE / --name=VALUE in MAIN_ARGS (the last one wins), else "jaxformer"; then die unless
# it is a valid run name (it names tmux sessions and log files).
run_name_from_args() {
  local args=("$@") i
  if [[ -z $name ]]; then
    for ((i = 0; i < ${#args[@]}; i++)); do
      [[ ${args[i]} == --name && $((i + 1)) -lt ${#args[@]} ]] && name=${args[i + 1]}
      [[ ${args[i]} == --name=* ]] && name=${args[i]#--name=}
    done
    name=${name:-jaxformer}
  fi
  [[ $name =~ ^[A-Za-z0-9_.-]+$ ]] || die "run name may hold only letters, digits, '_', '.', '-': '$name'"
}

# q WORD: WORD quoted for bash (printf %q). sq WORD: WORD in POSIX single quotes, for any login shell.
q() { printf '%q' "$1"; }
sq() { local s=${1//\'/\'\\\'\'}; printf "'%s'" "$s"; }
