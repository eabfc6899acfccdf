# shellcheck shell=bash
# launch_lib.sh: code shared by launcher.sh, debug_tpu.sh and run.sh, which source it from their own
# directory. Not run on its own. The caller defines die (print "SCRIPT: error: ...", exit 2), called
# from here so every message stays the caller's own.

# value OPTION [VALUE ...]: print VALUE; die (one line, exit 2) when OPTION has none. Use as
# `x=$(value "$@")` in an option loop: the caller's errexit then ends the script with die's status.
value() {
  [[ $# -ge 2 && $2 != --* ]] || die "$1 needs a value (see --help)"
  printf '%s' "$2"
}

# resolve_hosts HOSTS_FILE TPU ZONE PROJECT: set the global array `hosts` to the hosts named by
# --hosts HOSTS_FILE (one [user@]host a line; blank lines, # comments and CRLF line ends are fine; a
# line of several words is an error naming it) or, with TPU set, to the workers of that TPU VM
# (gcloud compute tpus tpu-vm describe). Dies on bad or missing input.
resolve_hosts() {
  local hosts_file=$1 tpu=$2 zone=$3 project=$4 line ips words n=0
  hosts=()
  if [[ -n $hosts_file ]]; then
    [[ -z $tpu ]] || die "give --hosts or --tpu, not both"
    [[ -f $hosts_file ]] || die "hosts file '$hosts_file' not found"
    while IFS= read -r line || [[ -n $line ]]; do
      n=$((n + 1)); line=${line%%#*}; line=${line//$'\r'/}
      read -ra words <<< "$line" || true
      ((${#words[@]} <= 1)) || die "hosts file '$hosts_file' line $n: '${line}' is not one [user@]host"
      ((${#words[@]} == 0)) || hosts+=("${words[0]}")
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
    die "missing --hosts FILE or --tpu NAME --zone ZONE (see --help)"
  fi
}

# run_name_from_args [MAIN_ARGS...]: the run's one name. main.py's own --name VALUE / --name=VALUE
# in MAIN_ARGS (the last one wins) must equal the global `name` when both are given (die otherwise);
# `name` is set from it when empty, else to "jaxformer". Sets `name_in_args` to 1 when MAIN_ARGS
# name the run. Dies unless the name is valid (it names tmux sessions and log files).
run_name_from_args() {
  local given=""
  name_in_args=""
  if given=$(arg_value --name "$@"); then name_in_args=1; fi
  if [[ -n $name && -n $name_in_args && $given != "$name" ]]; then
    die "--name '$name' differs from main.py's --name '$given' after --; give the run one name"
  fi
  name=${name:-${given:-jaxformer}}
  [[ $name =~ ^[A-Za-z0-9_.-]+$ ]] || die "run name may hold only letters, digits, '_', '.', '-': '$name'"
}

# arg_value FLAG [ARGS...]: print the value ARGS give FLAG (`FLAG VALUE` or `FLAG=VALUE`; the last one wins,
# as in main.py's parser); exit status 1 when they give it none
arg_value() {
  local flag=$1 i value="" found=1
  shift
  local args=("$@")
  for ((i = 0; i < ${#args[@]}; i++)); do
    [[ ${args[i]} == "$flag" && $((i + 1)) -lt ${#args[@]} ]] && value=${args[i + 1]} found=0
    [[ ${args[i]} == "$flag"=* ]] && value=${args[i]#"$flag"=} found=0
  done
  printf '%s' "$value"
  return "$found"
}

# q WORD: WORD quoted for bash (printf %q). sq WORD: WORD in POSIX single quotes, for any login shell.
q() { printf '%q' "$1"; }
sq() { local s=${1//\'/\'\\\'\'}; printf "'%s'" "$s"; }
