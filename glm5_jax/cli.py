"""The command-line entry points' one shape and one error rule. Every CLI defines absl flags in a
`define_flags()` (called only when run as a program, so importing a tool has no side effect) and starts
with `run(main, define_flags)`.

Help: `--help` (or -h, --helpshort, --helpfull) prints every flag the command accepts, the ones it borrows
from another CLI included (experiments.sweep takes experiments.run's), on stdout and exits 0; absl's own
flags (logging, debugging) are named on one line at the end.

Errors: an unknown flag, a bad flag value (a non-integer for an integer flag, a value outside an enum, a failed flag
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
import os
import re
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


HELP_ARGS = ("--help", "-h", "--helpshort", "--helpfull", "-?")


def help_text(fv: flags.FlagValues, prog: str, usage: str = "[flags]") -> str:
    """Every flag in fv, grouped by the module that defines it (this command's and the ones it borrows);
    absl's own flags (logging, debugging) by name on one line."""
    own, absl_names = [], []
    for module, fl in sorted(fv.flags_by_module_dict().items()):
        if module.startswith("absl."):
            absl_names += [f"--{f.name}" for f in fl]
        else:
            body = fv.module_help(module).strip().split("\n", 1)
            name = _prog(module) if module.endswith(".py") else module
            own.append(f"{name}:\n{body[1] if len(body) > 1 else ''}")
    text = f"usage: python -m {prog} {usage}\n\n" + ("\n\n".join(own) if own else "(no flags of its own)")
    if absl_names:
        text += "\n\nabsl's flags, also accepted: " + " ".join(sorted(set(absl_names)))
    return text


def wants_help(argv: Sequence[str]) -> bool:
    return any(a in HELP_ARGS for a in argv)


def flag_error(e: flags.Error, fv: flags.FlagValues) -> str:
    """One line for a bad flag: absl's message (it names the flag and value), what the flag takes where
    absl leaves that out ("a non-negative integer", "true or false"), and where the flags are listed."""
    msg = " ".join(str(e).split())
    m = re.match(r"flag --(\w+)=", msg)
    if m and m.group(1) in fv:
        flag = fv[m.group(1)]
        takes = "true or false" if flag.boolean else flag.parser.syntactic_help
        if takes and takes not in msg:
            msg += f"; --{flag.name} takes {takes}"
    return f"error: {msg} (--help lists the flags)"


def _parse(argv: Sequence[str], fv: flags.FlagValues) -> list[str] | None:
    """argv parsed into fv; None (after one "error: ..." line on stderr) when a flag is bad."""
    try:
        return fv(list(argv))
    except flags.Error as e:
        print(flag_error(e, fv), file=sys.stderr, flush=True)
        return None


def _prog(argv0: str) -> str:
    """`experiments.run` from sys.argv[0] (.../experiments/run.py)."""
    path = os.path.relpath(os.path.abspath(argv0)) if argv0 else "?"
    return path[:-3].replace(os.sep, ".") if path.endswith(".py") and not path.startswith("..") else argv0


def _parse_or_exit(argv: Sequence[str]) -> list[str]:
    if wants_help(argv[1:]):
        try:
            print(help_text(flags.FLAGS, _prog(argv[0])), flush=True)
        except BrokenPipeError:             # `--help | head`: the reader left; not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    rest = _parse(argv, flags.FLAGS)
    if rest is None:
        sys.exit(USAGE_EXIT)
    return rest


def run(main: Callable[[list[str]], int | None], define_flags: Callable[[], None] | None = None) -> None:
    """`python -m tool ...`: define the flags, parse sys.argv (a bad flag: "error: ..." and exit 2; --help
    prints every flag and exits 0), then exit with main's return value (absl's app.run)."""
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
    if wants_help(argv):
        print(help_text(flags.FLAGS, name), flush=True)
        return 0
    rest = _parse([name, *argv], flags.FLAGS)
    if rest is None:
        return USAGE_EXIT
    return int(main(rest) or 0)


__all__ = ["HELP_ARGS", "USAGE_EXIT", "call", "flag_error", "help_text", "main_wrapper", "run", "wants_help"]
