#!/usr/bin/env bash
# Manage a (multi-host) Cloud TPU VM for glm5-jax. See docs/launch.md.
#
#   tools/tpu_vm.sh create --name N --zone Z [--project P] [--accelerator v5p-128] [--version V] [--spot]
#   tools/tpu_vm.sh copy   --name N --zone Z [--project P] [--src DIR] [--remote_dir DIR]
#   tools/tpu_vm.sh run    --name N --zone Z [--project P] [--remote_dir DIR] -- CMD [ARGS...]
#   tools/tpu_vm.sh delete --name N --zone Z [--project P]
#
# Every gcloud command is echoed (prefixed with "+ ") before it runs; --dry_run only echoes and
# never needs gcloud. The dry-run code path uses bash builtins only.
set -euo pipefail

PROG="tools/tpu_vm.sh"
SUBCOMMANDS="create run copy delete"
FLAGS="--project --zone --accelerator --version --name --src --remote_dir --spot --dry_run --help"
ACCEL_FAMILIES="v4-N v5p-N v5litepod-N v6e-N (N = chip/core count, e.g. v5p-128)"

usage() {  # builtins only (no cat), so errors print even with an empty PATH
  local text
  IFS= read -r -d '' text <<EOF || true
usage: $PROG <create|run|copy|delete> --name NAME --zone ZONE [options] [-- CMD ...]

subcommands:
  create   create the TPU VM (gcloud compute tpus tpu-vm create)
  copy     copy this repo to every worker (tar + scp --worker=all + untar into --remote_dir)
  run      run CMD on all workers: ssh --worker=all --command='cd REMOTE_DIR && CMD'
  delete   delete the TPU VM (--quiet)

options:
  --name NAME          TPU VM name (required)
  --zone ZONE          e.g. us-east5-a (required)
  --project PROJECT    GCP project (default: gcloud's configured project)
  --accelerator TYPE   accelerator type, default v5p-8; allowed: $ACCEL_FAMILIES
  --version VERSION    TPU runtime version; default by family: v4 tpu-ubuntu2204-base,
                       v5p v2-alpha-tpuv5, v5litepod v2-alpha-tpuv5-lite, v6e v2-alpha-tpuv6e
  --spot               create a Spot VM (create only)
  --src DIR            local repo to copy (copy only; default: the repo containing this script)
  --remote_dir DIR     directory on the workers, relative to \$HOME (default: glm5-jax)
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
NAME="" ZONE="" PROJECT="" ACCEL="v5p-8" VERSION="" SPOT=0 DRY_RUN=0
SRC="" REMOTE_DIR="glm5-jax"
CMD=()

[[ $# -gt 0 ]] || die "missing subcommand; allowed: $SUBCOMMANDS"
case "$1" in
  -h|--help) usage; exit 0 ;;
  create|run|copy|delete) SUB=$1; shift ;;
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
    --spot) SPOT=1; shift ;;
    --dry_run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; CMD=("$@"); break ;;
    *) die "unknown flag '$arg' for '$SUB'; allowed: $FLAGS" ;;
  esac
done

[[ -n $NAME ]] || die "flag '--name' is required"
[[ $NAME =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || die "bad --name '$NAME': lowercase letters, digits and '-', starting with a letter"
[[ -n $ZONE ]] || die "flag '--zone' is required (e.g. us-east5-a)"
[[ $ZONE =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] || die "bad --zone '$ZONE': expected REGION-ZONE like us-east5-a"

[[ $ACCEL =~ ^(v4|v5p|v5litepod|v6e)-([0-9]+)$ ]] || die "bad --accelerator '$ACCEL'; allowed: $ACCEL_FAMILIES"
if [[ $SUB == create ]]; then
  [[ $ACCEL =~ ^(v4|v5p|v5litepod|v6e)-([0-9]+)$ ]] || die "bad --accelerator '$ACCEL'; allowed: $ACCEL_FAMILIES"
  if [[ -z $VERSION ]]; then
    case "${BASH_REMATCH[1]}" in
      v4) VERSION=tpu-ubuntu2204-base ;;
      v5p) VERSION=v2-alpha-tpuv5 ;;
      v5litepod) VERSION=v2-alpha-tpuv5-lite ;;
      v6e) VERSION=v2-alpha-tpuv6e ;;
    esac
  fi
else
  [[ $SPOT -eq 0 ]] || die "flag '--spot' is only valid for 'create'"
fi
[[ $SUB == run || ${#CMD[@]} -eq 0 ]] || die "'$SUB' takes no command after '--' (only 'run' does)"
[[ $SUB == copy || -z $SRC ]] || die "flag '--src' is only valid for 'copy'"
[[ $REMOTE_DIR =~ ^[A-Za-z0-9_./-]+$ ]] || die "bad --remote_dir '$REMOTE_DIR': letters, digits, '_', '.', '/', '-' only"

if [[ $DRY_RUN -eq 0 ]] && ! command -v gcloud >/dev/null 2>&1; then
  echo "$PROG: error: gcloud not found on PATH (install the Google Cloud SDK, or use --dry_run)" >&2
  exit 127
fi

COMMON=(--zone="$ZONE")
[[ -z $PROJECT ]] || COMMON+=(--project="$PROJECT")
TPU=(gcloud compute tpus tpu-vm)
TARBALL="/tmp/glm5-jax-src.tar.gz"

case "$SUB" in
  create)
    extra=()
    [[ $SPOT -eq 0 ]] || extra+=(--spot)
    run_cmd "${TPU[@]}" create "$NAME" "${COMMON[@]}" --accelerator-type="$ACCEL" --version="$VERSION" "${extra[@]}"
    ;;
  copy)
    if [[ -z $SRC ]]; then
      here=${BASH_SOURCE[0]%/*}
      [[ $here != "${BASH_SOURCE[0]}" ]] || here=.
      SRC="$(cd "$here/.." && pwd)"
    fi
    [[ -d $SRC ]] || die "bad --src '$SRC': not a directory"
    run_cmd tar --exclude=.git --exclude=__pycache__ --exclude=.venv -czf "$TARBALL" -C "$SRC" .
    run_cmd "${TPU[@]}" scp "$TARBALL" "$NAME:$TARBALL" "${COMMON[@]}" --worker=all
    run_cmd "${TPU[@]}" ssh "$NAME" "${COMMON[@]}" --worker=all \
      --command="mkdir -p ~/$REMOTE_DIR && tar -xzf $TARBALL -C ~/$REMOTE_DIR"
    ;;
  run)
    [[ ${#CMD[@]} -gt 0 ]] || die "'run' needs a command after '--', e.g. $PROG run --name N --zone Z -- python -m glm5_jax.train"
    remote=""
    for a in "${CMD[@]}"; do remote+="${remote:+ }$(quote "$a")"; done
    run_cmd "${TPU[@]}" ssh "$NAME" "${COMMON[@]}" --worker=all --command="cd ~/$REMOTE_DIR && $remote"
    ;;
  delete)
    run_cmd "${TPU[@]}" delete "$NAME" "${COMMON[@]}" --quiet
    ;;
esac
