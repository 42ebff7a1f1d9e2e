"""Subprocess of test_data_prepare_engine: tools.prepare_data run in this process (--workers=1) with every
shard's tokenize task slowed by DELAY seconds, so the test can kill it mid-run.

    python tests/prep_kill_worker.py DELAY PREPARE_DATA_FLAGS...
"""

import sys
import time


def main():
    delay = float(sys.argv[1])
    from glm5_jax.data.prep import driver
    from tools import prepare_data
    tokenize = driver.tokenize_shard

    def slow(*args):
        out = tokenize(*args)
        time.sleep(delay)
        return out

    driver.tokenize_shard = slow
    sys.exit(prepare_data.main(sys.argv[2:]))


if __name__ == "__main__":
    main()
