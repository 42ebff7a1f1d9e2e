"""Entry point of the child program: ``python -I -S -B <box>/sandbox_child '<json config>'``.

Run as a directory, sys.path[0] is this directory: it is replaced by its parent for as long as it takes
to import this package by its name (so its modules import one another relatively, as they do inside
glm5_jax), then removed, leaving the isolated interpreter's path as it was (stdlib only).
"""

import json
import os
import sys

if __package__:                     # python -m glm5_jax.rl.sandbox_child (debugging)
    from . import judge, solution
else:
    _here = sys.path[0]
    sys.path[0] = os.path.dirname(_here)
    _pkg = __import__(os.path.basename(_here), fromlist=["judge", "solution"])
    judge, solution = _pkg.judge, _pkg.solution
    del sys.path[0]

_cfg = json.loads(sys.argv[1])
if _cfg["role"] == "solution":
    solution.run(_cfg)
else:
    judge.run(_cfg)
