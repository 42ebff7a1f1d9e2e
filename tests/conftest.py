import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # libtpu (the TPU AOT tests) in parallel workers
os.environ.setdefault("GLM5_HUGEPAGES", "0")   # CLI subprocesses: no glm5_jax.hugepages re-exec (a second start-up each)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
