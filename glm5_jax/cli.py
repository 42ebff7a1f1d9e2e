"""The command-line entry points' one shape and one error rule. Every CLI defines absl flags in a
`define_flags()` (called only when run as a program, so importing a tool has no side effect) and starts
with `run(main, define_flags)`.

Errors: a bad flag value (a non-integer for an integer flag, a value outside an enum, a failed flag
validator, a required flag left out), a Glm5Error raised by `main` (glm5_jax.errors: a setting, input
or checkpoint the user can fix) and absl's `app.UsageError` raised by `main` all become one line, "error: MESSAGE", on stderr and exit status 2,
instead of a traceback. Anything else (a bug, a failing device, a diverged run) keeps its traceback.

    @main_wrapper                      # a Glm5Error -> "error: ..." and exit 2
    def main(argv): ...

    @main_wrapper(also=(OSError,))     # a CLI whose inputs are files: a missing one is a usage error too
    def main(argv): ...

    if __name__ == "__main__":
        run(main, define_flags)        # absl: parse the flags, exit with main's return value
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, Sequence

from absl import app, flags

from glm5_jax.errors import Glm5Error

USAGE_EXIT = 2


def main_wrapper(fn: Callable | None = None, *, also: tuple[type[BaseException], ...] = ()):
    """Decorate a CLI's main: Glm5Error, app.UsageError (and the `also` types) -> "error: ..." on stderr, return 2."""
    def wrap(main):
        @functools.wraps(main)
        def wrapped(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except (Glm5Error, app.UsageError, *also) as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                return USAGE_EXIT
        return wrapped
    return wrap(fn) if fn is not None else wrap


def _parse(argv: Sequence[str], fv: flags.FlagValues) -> list[str] | None:
    """argv parsed into fv; None (after one "error: ..." line on stderr) when a flag is bad."""
    try:
        return fv(list(argv))
    except flags.Error as e:
        print(f"error: {e} (--help lists the flags)", file=sys.stderr, flush=True)
        return None


def _parse_or_exit(argv: Sequence[str]) -> list[str]:
    rest = _parse(argv, flags.FLAGS)
    if rest is None:
        sys.exit(USAGE_EXIT)
    return rest


def run(main: Callable[[list[str]], int | None], define_flags: Callable[[], None] | None = None) -> None:
    """`python -m tool ...`: define the flags, parse sys.argv (a bad flag: "error: ..." and exit 2; --help
    prints the flags), then exit with main's return value (absl's app.run)."""
    if define_flags is not None:
        define_flags()
    app.run(main, flags_parser=_parse_or_exit)


_DEFINED: set[str] = set()


def call(main: Callable[[list[str]], int | None], define_flags: Callable[[], None], argv: Sequence[str]) -> int:
    """Run a CLI's main in this process as `python -m tool ARGV...` would and return its exit status
    (tests): its flags defined once per process, reset to their defaults, then `argv` parsed."""
    name = main.__module__
    if name not in _DEFINED:
        define_flags()
        _DEFINED.add(name)
    flags.FLAGS.unparse_flags()
    # other CLIs called in this process left their flags in the one registry: their required flags (a
    # validator that refuses None) must not fail this CLI's parse, so they hold a placeholder here
    own = {f.name for f in flags.FLAGS.flags_by_module_dict().get(name, [])}
    for fname, flag in ((n, flags.FLAGS[n]) for n in flags.FLAGS):
        if fname not in own and flag.value is None and flag.validators:
            flag.value = ""
    rest = _parse([name, *argv], flags.FLAGS)
    if rest is None:
        return USAGE_EXIT
    return int(main(rest) or 0)


__all__ = ["USAGE_EXIT", "call", "main_wrapper", "run"]
