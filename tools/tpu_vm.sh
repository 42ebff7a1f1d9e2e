#!/usr/bin/env bash
# Manage a (multi-host) Cloud TPU VM for glm5-jax and train on every worker. See docs/launch.md.
#
#   tools/tpu_vm.sh create --name N --zone Z [--project P] [--accelerator v5p-128] [--version V] [--spot] [--queued]
#   tools/tpu_vm.sh status --name N --zone Z [--project P] [--queued]
#   tools/tpu_vm.sh setup  --name N --zone Z [--project P] [--src DIR] [--remote_dir DIR] [--python PY]
#   tools/tpu_vm.sh train  --name N --zone Z [--project P] --config NAME [--mesh SPEC] [--set K=V ...] [-- ARGS...]
#   tools/tpu_vm.sh copy   --name N --zone Z [--project P] [--src DIR] [--remote_dir DIR]
#   tools/tpu_vm.sh run    --name N --zone Z [--project P] [--remote_dir DIR] -- CMD [ARGS...]
#   tools/tpu_vm.sh delete --name N --zone Z [--project P] [--queued]
#
# Every gcloud command is echoed (prefixed with "+ ") before it runs; --dry_run only echoes and
# never needs gcloud. The dry-run code path uses bash builtins only.
set -euo pipefail

PROG="tools/tpu_vm.sh"
SUBCOMMANDS="create status setup train copy run delete"
FLAGS="--project --zone --accelerator --version --name --src --remote_dir --python --config --mesh --set --spot --queued --dry_run --help"
ACCEL_FAMILIES="v4-N v5p-N v5litepod-N v6e-N (N = chip/core count, e.g. v5p-128)"

usage() {  # builtins only (no cat), so errors print even with an empty PATH
  local text
  IFS= read -r -d '' text <<EOF || true
usage: $PROG <create|status|setup|train|copy|run|delete> --name NAME --zone ZONE [options] [-- ARGS ...]

subcommands:
  create   create the TPU VM (gcloud compute tpus tpu-vm create); with --queued, a queued resource
           (gcloud compute tpus queued-resources create NAME --node-id=NAME) that waits for capacity
  status   describe the TPU VM; with --queued the queued resource (WAITING_FOR_RESOURCES ... ACTIVE)
  setup    copy this repo to every worker, then on every worker:
           PY -m pip install -r requirements.txt -e ".[tpu]"
  train    on every worker: GLM5_DISTRIBUTED=auto PY -m experiments.run --config=NAME [--mesh=SPEC]
           [--set=K=V ...] [ARGS after --]   (jax.distributed finds its peers from the TPU metadata)
  copy     copy this repo to every worker (tar + scp --worker=all + untar into --remote_dir)
  run      run CMD on all workers: ssh --worker=all --command='cd REMOTE_DIR && CMD'
  delete   delete the TPU VM (--quiet); with --queued the queued resource and its VM (--force)

options:
  --name NAME          TPU VM name (required; with --queued also the queued resource's id)
  --zone ZONE          e.g. us-east5-a (required)
  --project PROJECT    GCP project (default: gcloud's configured project)
  --accelerator TYPE   accelerator type, default v5p-8; allowed: $ACCEL_FAMILIES
  --version VERSION    TPU runtime version; default by family: v4 tpu-ubuntu2204-base,
                       v5p v2-alpha-tpuv5, v5litepod v2-alpha-tpuv5-lite, v6e v2-alpha-tpuv6e
  --spot               Spot capacity (create only)
  --queued             go through a queued resource (create, status, delete)
  --src DIR            local repo to copy (copy, setup; default: the repo containing this script)
  --remote_dir DIR     directory on the workers, relative to \$HOME (default: glm5-jax)
  --python PY          the workers' Python (setup, train; default python3, which TPU VM images have)
  --config NAME        experiment to train (train only; python -m experiments.run --list names them)
  --mesh SPEC          device mesh AXIS:N,... over data, fsdp, expert, context, tensor; -1 fills (train only)
  --set K=V            config override, repeatable (train only), e.g. --set train.batch_size=256
  --dry_run            print the exact commands, run nothing (gcloud not needed)
  --help               this text
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

# Print one argument shell-quoted (single quotes only when needed), builtins only.
quote() {
  local a=$1
  if [[ $a =~ ^(--[A-Za-z0-9_-]+=)(.*)$ ]]; then  # --flag=value: quote only the value
    printf '%s' "${BASH_REMATCH[1]}"
    a=${BASH_REMATCH[2]}
  fi
  if [[ -n $a && $a =~ ^[A-Za-z0-9_./=:,@%+~-]+$ ]]; then
    printf '%s' "$a"
  else
    printf "'%s'" "${a//\'/\'\\\'\'}"
  fi
}

# Echo a command ("+ cmd args"), then run it unless --dry_run.
run_cmd() {
  local out="+" a
  for a in "$@"; do out+=" $(quote "$a")"; done
  echo "$out"
  if [[ $DRY_RUN -eq 0 ]]; then
    "$@"
  fi
}

SUB=""
NAME="" ZONE="" PROJECT="" ACCEL="v5p-8" VERSION="" SPOT=0 QUEUED=0 DRY_RUN=0
SRC="" REMOTE_DIR="glm5-jax" PY="" CONFIG="" MESH=""
SETS=()
CMD=()

[[ $# -gt 0 ]] || die "missing subcommand; allowed: $SUBCOMMANDS"
case "$1" in
  -h|--help) usage; exit 0 ;;
  create|status|setup|train|copy|run|delete) SUB=$1; shift ;;
  *) die "unknown subcommand '$1'; allowed: $SUBCOMMANDS" ;;
esac

need_value() {  # flag, remaining-arg-count
  [[ $2 -ge 2 ]] || die "flag '$1' needs a value"
}

while [[ $# -gt 0 ]]; do
  arg=$1
  val=""
  if [[ $arg == --*=* ]]; then
    val=${arg#*=}
    arg=${arg%%=*}
    set -- "$arg" "$val" "${@:2}"
  fi
  case "$arg" in
    --name) need_value "$arg" $#; NAME=$2; shift 2 ;;
    --zone) need_value "$arg" $#; ZONE=$2; shift 2 ;;
    --project) need_value "$arg" $#; PROJECT=$2; shift 2 ;;
    --accelerator) need_value "$arg" $#; ACCEL=$2; shift 2 ;;
    --version) need_value "$arg" $#; VERSION=$2; shift 2 ;;
    --src) need_value "$arg" $#; SRC=$2; shift 2 ;;
    --remote_dir) need_value "$arg" $#; REMOTE_DIR=$2; shift 2 ;;
    --python) need_value "$arg" $#; PY=$2; shift 2 ;;
    --config) need_value "$arg" $#; CONFIG=$2; shift 2 ;;
    --mesh) need_value "$arg" $#; MESH=$2; shift 2 ;;
    --set) need_value "$arg" $#; SETS+=("$2"); shift 2 ;;
    --spot) SPOT=1; shift ;;
    --queued) QUEUED=1; shift ;;
    --dry_run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; CMD=("$@"); break ;;
    *) die "unknown flag '$arg' for '$SUB'; allowed: $FLAGS" ;;
  esac
done

only_for() {  # flag, is-set (0/1), allowed subcommands...
  local flag=$1 given=$2 s names=""
  shift 2
  [[ $given -eq 1 ]] || return 0
  for s in "$@"; do
    [[ $SUB != "$s" ]] || return 0
    names+="${names:+, }'$s'"
  done
  die "flag '$flag' is only valid for $names"
}

[[ -n $NAME ]] || die "flag '--name' is required"
[[ $NAME =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || die "bad --name '$NAME': lowercase letters, digits and '-', starting with a letter"
[[ -n $ZONE ]] || die "flag '--zone' is required (e.g. us-east5-a)"
[[ $ZONE =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] || die "bad --zone '$ZONE': expected REGION-ZONE like us-east5-a"
[[ $ACCEL =~ ^(v4|v5p|v5litepod|v6e)-([0-9]+)$ ]] || die "bad --accelerator '$ACCEL'; allowed: $ACCEL_FAMILIES"
if [[ -z $VERSION ]]; then
  case "${BASH_REMATCH[1]}" in
    v4) VERSION=tpu-ubuntu2204-base ;;
    v5p) VERSION=v2-alpha-tpuv5 ;;
    v5litepod) VERSION=v2-alpha-tpuv5-lite ;;
    v6e) VERSION=v2-alpha-tpuv6e ;;
  esac
fi
only_for --spot "$SPOT" create
only_for --queued "$QUEUED" create status delete
only_for --src "$([[ -n $SRC ]] && echo 1 || echo 0)" copy setup
only_for --python "$([[ -n $PY ]] && echo 1 || echo 0)" setup train
only_for --config "$([[ -n $CONFIG ]] && echo 1 || echo 0)" train
only_for --mesh "$([[ -n $MESH ]] && echo 1 || echo 0)" train
only_for --set "$([[ ${#SETS[@]} -gt 0 ]] && echo 1 || echo 0)" train
[[ $SUB == run || $SUB == train || ${#CMD[@]} -eq 0 ]] || die "'$SUB' takes no arguments after '--' (only 'run' and 'train' do)"
[[ $REMOTE_DIR =~ ^[A-Za-z0-9_./-]+$ ]] || die "bad --remote_dir '$REMOTE_DIR': letters, digits, '_', '.', '/', '-' only"
PY=${PY:-python3}
[[ $PY =~ ^[A-Za-z0-9_./~-]+$ ]] || die "bad --python '$PY': a command name or path"
if [[ $SUB == train ]]; then
  [[ -n $CONFIG ]] || die "flag '--config' is required for 'train' (python -m experiments.run --list names the experiments)"
  [[ $CONFIG =~ ^[A-Za-z0-9_]+$ ]] || die "bad --config '$CONFIG': an experiment name (letters, digits, '_')"
  [[ -z $MESH ]] || check_mesh "$MESH" fsdp:-1,expert:4
  for kv in "${SETS[@]}"; do
    [[ $kv =~ ^[A-Za-z0-9_.]+=.+$ ]] || die "bad --set '$kv': expected section.field=value"
  done
fi

if [[ $DRY_RUN -eq 0 ]] && ! command -v gcloud >/dev/null 2>&1; then
  echo "$PROG: error: gcloud not found on PATH (install the Google Cloud SDK, or use --dry_run)" >&2
  exit 127
fi

COMMON=(--zone="$ZONE")
[[ -z $PROJECT ]] || COMMON+=(--project="$PROJECT")
TPU=(gcloud compute tpus tpu-vm)
QR=(gcloud compute tpus queued-resources)
TARBALL="/tmp/glm5-jax-src.tar.gz"

copy_repo() {
  if [[ -z $SRC ]]; then
    local here=${BASH_SOURCE[0]%/*}
    [[ $here != "${BASH_SOURCE[0]}" ]] || here=.
    SRC="$(cd "$here/.." && pwd)"
  fi
  [[ -d $SRC ]] || die "bad --src '$SRC': not a directory"
  run_cmd tar --exclude=.git --exclude=__pycache__ --exclude=.venv -czf "$TARBALL" -C "$SRC" .
  run_cmd "${TPU[@]}" scp "$TARBALL" "$NAME:$TARBALL" "${COMMON[@]}" --worker=all
  run_cmd "${TPU[@]}" ssh "$NAME" "${COMMON[@]}" --worker=all \
    --command="mkdir -p ~/$REMOTE_DIR && tar -xzf $TARBALL -C ~/$REMOTE_DIR"
}

on_all_workers() {  # remote command (already shell-quoted), run from REMOTE_DIR on every worker
  run_cmd "${TPU[@]}" ssh "$NAME" "${COMMON[@]}" --worker=all --command="cd ~/$REMOTE_DIR && $1"
}

case "$SUB" in
  create)
    extra=()
    [[ $SPOT -eq 0 ]] || extra+=(--spot)
    if [[ $QUEUED -eq 1 ]]; then
      run_cmd "${QR[@]}" create "$NAME" --node-id="$NAME" "${COMMON[@]}" --accelerator-type="$ACCEL" \
        --runtime-version="$VERSION" "${extra[@]}"
    else
      run_cmd "${TPU[@]}" create "$NAME" "${COMMON[@]}" --accelerator-type="$ACCEL" --version="$VERSION" "${extra[@]}"
    fi
    ;;
  status)
    if [[ $QUEUED -eq 1 ]]; then
      run_cmd "${QR[@]}" describe "$NAME" "${COMMON[@]}"
    else
      run_cmd "${TPU[@]}" describe "$NAME" "${COMMON[@]}"
    fi
    ;;
  copy)
    copy_repo
    ;;
  setup)
    copy_repo
    on_all_workers "$PY -m pip install -r requirements.txt -e \".[tpu]\""
    ;;
  train)
    remote="GLM5_DISTRIBUTED=auto $(quote "$PY") -m experiments.run --config=$CONFIG"
    [[ -z $MESH ]] || remote+=" --mesh=$MESH"
    for kv in "${SETS[@]}"; do remote+=" $(quote "--set=$kv")"; done
    for a in "${CMD[@]}"; do remote+=" $(quote "$a")"; done
    on_all_workers "$remote"
    ;;
  run)
    [[ ${#CMD[@]} -gt 0 ]] || die "'run' needs a command after '--', e.g. $PROG run --name N --zone Z -- python3 -m experiments.run --list"
    remote=""
    for a in "${CMD[@]}"; do remote+="${remote:+ }$(quote "$a")"; done
    on_all_workers "$remote"
    ;;
  delete)
    if [[ $QUEUED -eq 1 ]]; then
      run_cmd "${QR[@]}" delete "$NAME" "${COMMON[@]}" --force --quiet
    else
      run_cmd "${TPU[@]}" delete "$NAME" "${COMMON[@]}" --quiet
    fi
    ;;
esac
