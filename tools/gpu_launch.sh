#!/usr/bin/env bash
# Multi-node GPU launcher for glm5-jax: resolves the jax.distributed topology, exports it, execs CMD.
# See docs/launch.md.
#
#   tools/gpu_launch.sh [--coordinator HOST:PORT] [--num_processes N] [--process_id I]
#                       [--port P] [--local_device_ids 0,1,...] [--dry_run] -- CMD [ARGS...]
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
FLAGS="--coordinator --num_processes --process_id --port --local_device_ids --dry_run --help"

usage() {  # builtins only (no cat), so errors print even with an empty PATH
  local text
  IFS= read -r -d '' text <<EOF || true
usage: $PROG [options] -- CMD [ARGS...]

options:
  --coordinator HOST:PORT   coordinator (process 0) address; default: first SLURM host:PORT,
                            else 127.0.0.1:PORT
  --num_processes N         total processes (integer >= 1); default: \$SLURM_NTASKS, else 1
  --process_id I            this process' id (0 <= I < N); default: \$SLURM_PROCID, else 0
  --port P                  coordinator port when --coordinator is not given (default 12355)
  --local_device_ids LIST   comma-separated local GPU ids for this process (e.g. 0,1,2,3)
  --dry_run                 print the exports and the command, run nothing
  --help                    this text

exports: GLM5_COORDINATOR_ADDRESS, GLM5_NUM_PROCESSES, GLM5_PROCESS_ID[, GLM5_LOCAL_DEVICE_IDS]
SLURM:   srun --ntasks-per-node=1 $PROG -- python -m glm5_jax.train ...
EOF
  printf '%s' "$text"
}

die() {
  echo "$PROG: error: $*" >&2
  echo >&2
  usage >&2
  exit 2
}

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

COORD="" NPROC="" PID_="" PORT="12355" LOCAL_IDS="" DRY_RUN=0
CMD=()

while [[ $# -gt 0 ]]; do
  arg=$1
  if [[ $arg == --*=* ]]; then
    set -- "${arg%%=*}" "${arg#*=}" "${@:2}"
    arg=$1
  fi
  case "$arg" in
    --coordinator | --num_processes | --process_id | --port | --local_device_ids)
      [[ $# -ge 2 ]] || die "flag '$arg' needs a value"
      case "$arg" in
        --coordinator) COORD=$2 ;;
        --num_processes) NPROC=$2 ;;
        --process_id) PID_=$2 ;;
        --port) PORT=$2 ;;
        --local_device_ids) LOCAL_IDS=$2 ;;
      esac
      shift 2 ;;
    --dry_run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; CMD=("$@"); break ;;
    *) die "unknown flag '$arg'; allowed: $FLAGS (put the command after '--')" ;;
  esac
done

[[ ${#CMD[@]} -gt 0 ]] || die "missing command after '--', e.g. $PROG -- python -m glm5_jax.train"
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
out="+"
for a in "${CMD[@]}"; do out+=" $(quote "$a")"; done
echo "$out"
if [[ $DRY_RUN -eq 1 ]]; then
  exit 0
fi
exec "${CMD[@]}"
