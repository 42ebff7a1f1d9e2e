"""The project's error vocabulary, at the bottom of the import graph (this module imports nothing of it).

`Glm5Error` is the root of every error that a user can fix by changing what they asked for: a setting, an
input file, a checkpoint, a mesh, an experiment name. It subclasses ValueError, so `except ValueError`
keeps catching all of them. The command-line entry points map it to one line on stderr and exit status 2
(glm5_jax.cli.main_wrapper). Failures of a running job (a diverged run, a lost worker, a damaged orbax
checkpoint) are not Glm5Errors: they are RuntimeErrors and keep their tracebacks.

`ConfigError`: a config field has a value that is not allowed; the message names the field, the value
and the rule, e.g. "TrainConfig.steps=0 is invalid: must be an integer >= 1" (the rules are declared on
the fields: glm5_jax.fields).
"""


class Glm5Error(ValueError):
    """A setting, input or checkpoint that is not allowed; the message says what is allowed instead."""


class ConfigError(Glm5Error):
    """A config field has a value that is not allowed; the message names field, value and rule."""


__all__ = ["ConfigError", "Glm5Error"]
