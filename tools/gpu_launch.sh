#!/usr/bin/env bash
# Multi-node GPU launcher for glm5-jax: resolves the jax.distributed topology, exports it, and starts
# the entry point (python -m experiments.run) or CMD on this worker. See docs/launch.md.
#
#   tools/gpu_launch.sh [topology flags] [--install] --config NAME [--mesh SPEC] [--set K=V ...] [-- ARGS...]
#   tools/gpu_launch.sh [topology flags] [--install] -- CMD [ARGS...]
#   topology flags: [--coordinator HOST:PORT] [--num_processes N] [--process_id I] [--port P]
#                   [--local_device_ids 0,1,...] [--python PY] [--dry_run]
#
# --install first runs, from the repo root: PY -m pip install -r requirements.txt -e ".[cuda12]".
# --config runs, from the repo root: PY -m experiments.run --config=NAME [--mesh=SPEC] [--set=K=V ...] [ARGS].
#
# Exported for the training code (which calls jax.distributed.initialize with them):
#   GLM5_COORDINATOR_ADDRESS  host:port of process 0
#   GLM5_NUM_PROCESSES        total number of processes
#   GLM5_PROCESS_ID           this process' id in [0, GLM5_NUM_PROCESSES)
#   GLM5_LOCAL_DEVICE_IDS     only when --local_device_ids is given (comma-separated)
# Resolution order per value: explicit flag > SLURM (SLURM_PROCID, SLURM_NTASKS, first host of
# SLURM_JOB_NODELIST via `scontrol show hostnames`, or a builtin parser when scontrol is absent)
# > single-process default (127.0.0.1:PORT, 1 process, id 0).
set -euo pipefail

PROG="tools/gpu_launch.sh"
FLAGS="--coordinator --num_processes --process_id --port --local_device_ids --config --mesh --set --install --python --dry_run --help"

usage() {  # builtins only (no cat), so errors print even with an empty PATH
  local text
  IFS= read -r -d '' text <<EOF || true
usage: $PROG [options] [--install] --config NAME [--mesh SPEC] [--set K=V ...] [-- ARGS...]
       $PROG [options] [--install] -- CMD [ARGS...]

options:
  --coordinator HOST:PORT   coordinator (process 0) address; default: first SLURM host:PORT,
                            else 127.0.0.1:PORT
  --num_processes N         total processes (integer >= 1); default: \$SLURM_NTASKS, else 1
  --process_id I            this process' id (0 <= I < N); default: \$SLURM_PROCID, else 0
  --port P                  coordinator port when --coordinator is not given (default 12355)
  --local_device_ids LIST   comma-separated local GPU ids for this process (e.g. 0,1,2,3)
  --config NAME             run the entry point PY -m experiments.run --config=NAME from the repo root
                            (arguments after '--' are appended to it)
  --mesh SPEC               device mesh AXIS:N,... over data, fsdp, expert, context, tensor; -1 fills (with --config)
  --set K=V                 config override, repeatable (with --config), e.g. --set train.batch_size=256
  --install                 first install the CUDA 12 extra from the repo root:
                            PY -m pip install -r requirements.txt -e ".[cuda12]"
  --python PY               the Python to install into and run (default: python)
  --dry_run                 print the exports and the commands, run nothing
  --help                    this text

exports: GLM5_COORDINATOR_ADDRESS, GLM5_NUM_PROCESSES, GLM5_PROCESS_ID[, GLM5_LOCAL_DEVICE_IDS]
SLURM:   srun --ntasks-per-node=1 $PROG --install --config=dsa_vs_mla --mesh=fsdp:-1
EOF
  printf '%s' "$text"
}

die() {
  echo "$PROG: error: $*" >&2
  echo >&2
  usage >&2
  exit 2
}

# check_mesh and MESH_AXES, shared with the other launch script (builtins only: `source`, no dirname)
source "${BASH_SOURCE[0]%/*}/launch_mesh.sh"

quote() {
  local a=$1
  if [[ -n $a && $a =~ ^[A-Za-z0-9_./=:,@%+~-]+$ ]]; then
    printf '%s' "$a"
  else
    printf "'%s'" "${a//\'/\'\\\'\'}"
  fi
}

# First hostname of a SLURM nodelist such as "gpu[017-020,031],cpu5" -> gpu017 (bash builtins only).
first_host_builtin() {
  local list=$1 head rest inner first
  # the first comma not inside brackets ends the first entry
  local i c depth=0
  head=$list
  for ((i = 0; i < ${#list}; i++)); do
    c=${list:i:1}
    if [[ $c == "[" ]]; then depth=$((depth + 1)); fi
    if [[ $c == "]" ]]; then depth=$((depth - 1)); fi
    if [[ $c == "," && $depth -eq 0 ]]; then head=${list:0:i}; break; fi
  done
  if [[ $head == *"["* ]]; then
    rest=${head#*[}
    inner=${rest%%]*}
    first=${inner%%,*}
    first=${first%%-*}
    printf '%s%s%s' "${head%%[*}" "$first" "${rest#*]}"
  else
    printf '%s' "$head"
  fi
}

first_slurm_host() {
  local nl=$1 h=""
  if command -v scontrol >/dev/null 2>&1; then
    h=$(scontrol show hostnames "$nl" 2>/dev/null | { read -r x || true; printf '%s' "${x:-}"; })
  fi
  [[ -n $h ]] || h=$(first_host_builtin "$nl")
  printf '%s' "$h"
}

COORD="" NPROC="" PID_="" PORT="12355" LOCAL_IDS="" DRY_RUN=0 INSTALL=0 PY="python" CONFIG="" MESH=""
SETS=()
CMD=()

while [[ $# -gt 0 ]]; do
  arg=$1
  if [[ $arg == --*=* ]]; then
    set -- "${arg%%=*}" "${arg#*=}" "${@:2}"
    arg=$1
  fi
  case "$arg" in
    --coordinator | --num_processes | --process_id | --port | --local_device_ids | --config | --mesh | --set | --python)
      [[ $# -ge 2 ]] || die "flag '$arg' needs a value"
      case "$arg" in
        --coordinator) COORD=$2 ;;
        --num_processes) NPROC=$2 ;;
        --process_id) PID_=$2 ;;
        --port) PORT=$2 ;;
        --local_device_ids) LOCAL_IDS=$2 ;;
        --config) CONFIG=$2 ;;
        --mesh) MESH=$2 ;;
        --set) SETS+=("$2") ;;
        --python) PY=$2 ;;
      esac
      shift 2 ;;
    --install) INSTALL=1; shift ;;
    --dry_run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; CMD=("$@"); break ;;
    *) die "unknown flag '$arg'; allowed: $FLAGS (put the command after '--')" ;;
  esac
done

[[ -n $CONFIG || ${#CMD[@]} -gt 0 ]] ||
  die "missing --config NAME or a command after '--', e.g. $PROG --config=dsa_vs_mla --mesh=fsdp:-1"
[[ -n $CONFIG || ( -z $MESH && ${#SETS[@]} -eq 0 ) ]] || die "flags '--mesh' and '--set' need --config"
[[ $PY =~ ^[A-Za-z0-9_./~-]+$ ]] || die "bad --python '$PY': a command name or path"
if [[ -n $CONFIG ]]; then
  [[ $CONFIG =~ ^[A-Za-z0-9_]+$ ]] || die "bad --config '$CONFIG': an experiment name (letters, digits, '_')"
  [[ -z $MESH ]] || check_mesh "$MESH" fsdp:-1,expert:8
  for kv in "${SETS[@]}"; do
    [[ $kv =~ ^[A-Za-z0-9_.]+=.+$ ]] || die "bad --set '$kv': expected section.field=value"
  done
  ENTRY=("$PY" -m experiments.run --config="$CONFIG")
  [[ -z $MESH ]] || ENTRY+=(--mesh="$MESH")
  for kv in "${SETS[@]}"; do ENTRY+=(--set="$kv"); done
  CMD=("${ENTRY[@]}" "${CMD[@]}")
fi
[[ $PORT =~ ^[0-9]+$ && $PORT -ge 1 && $PORT -le 65535 ]] || die "bad --port '$PORT': integer in 1..65535"

SOURCE="flags/default"
if [[ -n ${SLURM_JOB_ID:-}${SLURM_NTASKS:-}${SLURM_PROCID:-} ]]; then SOURCE="slurm"; fi
if [[ -z $NPROC ]]; then NPROC=${SLURM_NTASKS:-1}; fi
if [[ -z $PID_ ]]; then PID_=${SLURM_PROCID:-0}; fi
if [[ -z $COORD ]]; then
  if [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
    COORD="$(first_slurm_host "$SLURM_JOB_NODELIST"):$PORT"
  elif [[ -n ${SLURM_NODELIST:-} ]]; then
    COORD="$(first_slurm_host "$SLURM_NODELIST"):$PORT"
  else
    [[ $NPROC == 1 ]] || die "flag '--coordinator' is required when --num_processes > 1 outside SLURM"
    COORD="127.0.0.1:$PORT"
  fi
fi

[[ $NPROC =~ ^[0-9]+$ && $NPROC -ge 1 ]] || die "bad --num_processes '$NPROC' (or SLURM_NTASKS): integer >= 1"
[[ $PID_ =~ ^[0-9]+$ ]] || die "bad --process_id '$PID_' (or SLURM_PROCID): integer >= 0"
[[ $PID_ -lt $NPROC ]] || die "bad --process_id '$PID_': must be < num_processes ($NPROC)"
[[ $COORD =~ ^[A-Za-z0-9_.:-]+:[0-9]+$ || $COORD =~ ^\[[0-9A-Fa-f:]+\]:[0-9]+$ ]] ||
  die "bad --coordinator '$COORD': expected HOST:PORT"
[[ -z $LOCAL_IDS || $LOCAL_IDS =~ ^[0-9]+(,[0-9]+)*$ ]] ||
  die "bad --local_device_ids '$LOCAL_IDS': comma-separated integers, e.g. 0,1,2,3"

export GLM5_COORDINATOR_ADDRESS="$COORD"
export GLM5_NUM_PROCESSES="$NPROC"
export GLM5_PROCESS_ID="$PID_"
VARS=(GLM5_COORDINATOR_ADDRESS GLM5_NUM_PROCESSES GLM5_PROCESS_ID)
if [[ -n $LOCAL_IDS ]]; then
  export GLM5_LOCAL_DEVICE_IDS="$LOCAL_IDS"
  VARS+=(GLM5_LOCAL_DEVICE_IDS)
fi

echo "# $PROG: topology from $SOURCE"
for v in "${VARS[@]}"; do echo "export $v=$(quote "${!v}")"; done

show() {  # echo "+ cmd args" (shell-quoted)
  local out="+" a
  for a in "$@"; do out+=" $(quote "$a")"; done
  echo "$out"
}

if [[ -n $CONFIG || $INSTALL -eq 1 ]]; then
  # The entry point's module paths, requirements.txt and the default workdir runs/NAME are relative
  # to the repo root.
  here=${BASH_SOURCE[0]%/*}
  [[ $here != "${BASH_SOURCE[0]}" ]] || here=.
  ROOT="$(cd "$here/.." && pwd)"
  show cd "$ROOT"
  [[ $DRY_RUN -eq 1 ]] || cd "$ROOT"
fi
if [[ $INSTALL -eq 1 ]]; then
  INSTALL_CMD=("$PY" -m pip install -r requirements.txt -e ".[cuda12]")
  show "${INSTALL_CMD[@]}"
  [[ $DRY_RUN -eq 1 ]] || "${INSTALL_CMD[@]}"
fi
show "${CMD[@]}"
if [[ $DRY_RUN -eq 1 ]]; then
  exit 0
fi
exec "${CMD[@]}"
