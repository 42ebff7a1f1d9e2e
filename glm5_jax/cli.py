"""The command-line entry points' one error rule: a Glm5Error (glm5_jax.errors: a setting, input or
checkpoint the user can fix) becomes one line, "error: MESSAGE", on stderr and exit status 2, before
or instead of a traceback. Anything else (a bug, a failing device, a diverged run) keeps its traceback.

    @main_wrapper                      # absl: app.run(main) exits with main's return value
    def main(argv): ...

    @main_wrapper(also=(OSError,))     # a CLI whose inputs are files: a missing one is a usage error too
    def main(argv=None) -> int: ...    # argparse: sys.exit(main())
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

from glm5_jax.errors import Glm5Error

USAGE_EXIT = 2


def main_wrapper(fn: Callable | None = None, *, also: tuple[type[BaseException], ...] = ()):
    """Decorate a CLI's main: Glm5Error (and the `also` types) -> "error: ..." on stderr, return 2."""
    def wrap(main):
        @functools.wraps(main)
        def wrapped(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except (Glm5Error, *also) as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                return USAGE_EXIT
        return wrapped
    return wrap(fn) if fn is not None else wrap


__all__ = ["USAGE_EXIT", "main_wrapper"]
