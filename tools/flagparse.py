"""Parse a CLI's own absl FlagValues (tools.aot, tools.budget): each tool defines its flags into a fresh
`flags.FlagValues()`, so two tools in one process (tests) never collide over a flag name such as --json.

    rest = parse(fv, "tools.aot", argv)      # the positional arguments, or an int exit status to return
"""

from __future__ import annotations

import sys
from typing import Sequence

from absl import flags

from glm5_jax.cli import USAGE_EXIT, flag_error, help_text, wants_help


def parse(fv: flags.FlagValues, prog: str, argv: Sequence[str] | None, usage: str = "[flags]") -> list[str] | int:
    """argv (without the program name; None: sys.argv[1:]) parsed into fv -> the positional arguments.
    --help / -h: the flags' help on stdout and 0; a bad flag (unknown, wrong type, a value outside an enum,
    a required one missing): one "error: ..." line on stderr and USAGE_EXIT (2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(help_text(fv, prog, usage))
        return 0
    try:
        return fv([prog, *argv])[1:]
    except flags.Error as e:
        print(flag_error(e, fv), file=sys.stderr, flush=True)
        return USAGE_EXIT
