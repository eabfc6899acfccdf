#!/usr/bin/env bash
# setup_tpu.sh: make this host ready to run JAXformer: a virtualenv with the pinned requirements.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: setup_tpu.sh [options]

Creates (or reuses) a virtualenv and installs the pinned requirements into it: requirements-tpu.txt
(requirements.txt plus libtpu) on a TPU VM, requirements.txt plus jax[cuda12] at the pinned version with
an NVIDIA GPU, requirements.txt alone on CPU.
Idempotent: a second run with the same requirements and accelerator installs nothing and edits no
file. Non-interactive. Run it on every host, e.g. with debug_tpu.sh or
`gcloud compute tpus tpu-vm ssh NAME --zone Z --worker=all --command "cd JAXformer && ./setup_tpu.sh"`.

options:
  --venv DIR             virtualenv location (default: .venv in this checkout)
  --python PY            interpreter that creates the virtualenv (default: python3)
  --accelerator A        auto (default), tpu, cuda or cpu
  --bashrc               activate the virtualenv in ~/.bashrc (one marked line, added once)
  --wandb-login          log in to Weights & Biases with $WANDB_API_KEY from the environment
                         (the key is never printed or put on a command line)
  --reinstall            install even if this requirements set is already installed
  --dry-run              print what would be done, change nothing
  -h, --help             this help
EOF
}

die() { echo "setup_tpu.sh: error: $*" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch_lib.sh
. "$here/launch_lib.sh"

venv="$here/.venv" python=python3 accel=auto bashrc=0 wandb_login=0 reinstall=0 dry_run=0
while (($#)); do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --venv) venv=$(value "$@"); shift 2 ;;
    --python) python=$(value "$@"); shift 2 ;;
    --accelerator) accel=$(value "$@"); shift 2 ;;
    --bashrc) bashrc=1; shift ;;
    --wandb-login) wandb_login=1; shift ;;
    --reinstall) reinstall=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ $accel =~ ^(auto|tpu|cuda|cpu)$ ]] || die "--accelerator must be auto, tpu, cuda or cpu, got '$accel'"
requirements="$here/requirements.txt"
[[ -f $requirements ]] || die "no requirements.txt next to this script ($requirements)"
tpu_requirements="$here/requirements-tpu.txt"
((wandb_login == 0)) || [[ -n ${WANDB_API_KEY:-} ]] || die "--wandb-login needs WANDB_API_KEY in the environment"

if [[ $accel == auto ]]; then
  if compgen -G '/dev/accel*' >/dev/null || compgen -G '/dev/vfio/[0-9]*' >/dev/null; then accel=tpu
  elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then accel=cuda
  else accel=cpu; fi
fi
jax_version=$(sed -n 's/^jax==\([^[:space:]#]*\).*/\1/p' "$requirements")
[[ -n $jax_version ]] || die "requirements.txt pins no jax==VERSION"
extra=()
case $accel in
  tpu) [[ -f $tpu_requirements ]] || die "no requirements-tpu.txt next to this script ($tpu_requirements)"
       requirements=$tpu_requirements ;;     # includes requirements.txt; libtpu is pinned there
  cuda) extra=("jax[cuda12]==$jax_version") ;;
esac

# what is installed is recorded in the venv; the same requirements + extra again means nothing to do
stamp_file="$venv/.jaxformer-installed"
stamp="$( { cat "$here/requirements.txt" "$requirements"; echo "extra: ${extra[*]:-none}"; } | sha256sum | cut -d' ' -f1)"
run() { echo "+ $*"; ((dry_run)) || "$@"; }

echo "setup_tpu.sh: accelerator $accel, virtualenv $venv"
if [[ -x $venv/bin/python ]]; then
  echo "setup_tpu.sh: reusing virtualenv $venv"
else
  command -v "$python" >/dev/null || die "'$python' not found; install Python 3.11 (sudo apt-get install -y python3-venv)"
  run "$python" -m venv "$venv"
fi
if ((reinstall == 0)) && [[ -f $stamp_file && $(cat "$stamp_file") == "$stamp" ]]; then
  echo "setup_tpu.sh: requirements already installed (--reinstall to force)"
else
  run "$venv/bin/python" -m pip install --quiet --upgrade pip
  run "$venv/bin/python" -m pip install --quiet -r "$requirements"
  if ((${#extra[@]})); then
    run "$venv/bin/python" -m pip install --quiet "${extra[@]}"
  fi
  if ((dry_run)); then echo "+ record $stamp in $stamp_file"; else echo "$stamp" > "$stamp_file"; fi
fi

if ! command -v tmux >/dev/null; then
  echo "setup_tpu.sh: note: tmux is missing; run.sh needs it (sudo apt-get install -y tmux)" >&2
fi

if ((bashrc)); then
  marker="# jaxformer venv (setup_tpu.sh)"
  line="[ -f $(printf '%q' "$venv/bin/activate") ] && . $(printf '%q' "$venv/bin/activate")  $marker"
  if grep -qF "$marker" "$HOME/.bashrc" 2>/dev/null; then
    echo "setup_tpu.sh: ~/.bashrc already activates the virtualenv"
  elif ((dry_run)); then
    echo "+ append to ~/.bashrc: $line"
  else
    echo "$line" >> "$HOME/.bashrc"
    echo "setup_tpu.sh: ~/.bashrc now activates the virtualenv"
  fi
fi

if ((wandb_login)); then
  echo "+ $venv/bin/python -c 'wandb.login(key=\$WANDB_API_KEY)'"
  ((dry_run)) || "$venv/bin/python" -c \
    'import os, wandb; wandb.login(key=os.environ["WANDB_API_KEY"], relogin=False)'
fi
echo "setup_tpu.sh: done"
