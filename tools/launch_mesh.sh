# Sourced by tools/tpu_vm.sh and tools/gpu_launch.sh (they define `die`): the --mesh check.
# The mesh axes of glm5_jax.sharding.MESH_AXES (tests/test_launch_scripts.py checks they agree), so a
# misspelt axis fails here, before any worker starts, rather than in experiments.run on every worker.
MESH_AXES="data fsdp expert context tensor"

check_mesh() {  # spec, example; builtins only
  local spec=$1 rest part
  [[ $spec =~ ^[a-z]+:-?[0-9]+(,[a-z]+:-?[0-9]+)*$ ]] ||
    die "bad --mesh '$spec': AXIS:N,... over ${MESH_AXES// /, } (e.g. $2)"
  rest=$spec,
  while [[ -n $rest ]]; do
    part=${rest%%,*}
    rest=${rest#*,}
    [[ " $MESH_AXES " == *" ${part%%:*} "* ]] ||
      die "bad --mesh '$spec': unknown axis '${part%%:*}'; allowed: ${MESH_AXES// /, }"
  done
}
