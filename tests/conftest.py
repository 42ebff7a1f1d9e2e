import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # libtpu (the TPU AOT tests) in parallel workers
os.environ.setdefault("GLM5_HUGEPAGES", "0")   # CLI subprocesses: no glm5_jax.hugepages re-exec (a second start-up each)
# Test-suite speed (the suite is compile-bound: tiny models, CPU): XLA's CPU backend skips its expensive
# LLVM passes (compiles ~2x faster, the tiny programs run no slower), and one persistent compilation
# cache for the session (xdist workers and subprocesses inherit the variables), so a program compiled
# twice (a resumed run, the same step in two tests) compiles once. Set either variable to override.
_FAST = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST).strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="glm5_jax_test_xla_cache_")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Model-written code runs only isolated (glm5_jax.rl.sandbox fails closed). On a machine where no namespace
# backend works (no root / CAP_SYS_ADMIN, no bubblewrap) the suite's code-running tests use the explicit
# development opt-out, said once here; the fail-closed tests (test_sandbox_failclosed.py) set their own policy.
if "GLM5_SANDBOX_ISOLATION" not in os.environ:
    from glm5_jax.rl.sandbox import isolation_available

    if isolation_available() != "on":
        os.environ["GLM5_SANDBOX_ISOLATION"] = "off"
        print(f"conftest: sandbox isolation {isolation_available()}: GLM5_SANDBOX_ISOLATION=off for this run",
              file=sys.stderr)
