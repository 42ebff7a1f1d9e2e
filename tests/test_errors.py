"""One error vocabulary (docs/architecture.md, "Errors and validation"): every user-fixable error derives
from Glm5Error, field rules are declared on the config fields and read by one validator, the runtime
field lists come from that metadata, and the CLIs map a Glm5Error to one line and exit status 2."""

import dataclasses

import pytest

from absl import flags

from glm5_jax.cli import call, main_wrapper
from glm5_jax.config import ModelConfig
from glm5_jax.errors import ConfigError, Glm5Error
from glm5_jax.fields import check_fields, fields_with, require, setting


def test_every_user_error_derives_from_the_root():
    from glm5_jax.overrides import OverrideError
    from experiments.registry import ExperimentError
    from glm5_jax.data.chat import ChatFormatError
    from glm5_jax.data.clean import CleanConfigError
    from glm5_jax.data.sources import DataError
    from glm5_jax.hf import CheckpointError
    from glm5_jax.parallel.distributed import DistributedConfigError
    from glm5_jax.rl.reward_model import PairFormatError
    from glm5_jax.serve.engine import EngineError
    from glm5_jax.sharding import MeshError
    from glm5_jax.train.checkpoint import InitFromError
    from tools.aot import AotError
    for cls in (ConfigError, DataError, OverrideError, ExperimentError, ChatFormatError, CleanConfigError,
                CheckpointError, DistributedConfigError, PairFormatError, EngineError, MeshError, InitFromError,
                AotError):
        assert issubclass(cls, Glm5Error) and issubclass(cls, ValueError), cls


@dataclasses.dataclass(frozen=True)
class _Knobs:
    n: int = setting(1, integer=True, min=1)
    frac: float = setting(0.5, gt=0, lt=1, note="(a share)")
    kind: str = setting("a", choices=("a", "b"))
    cap: int | None = setting(None, integer=True, min=2, optional=True, when=lambda c: c.kind == "b")
    chunk: int = setting(8, integer=True, min=1, runtime=True)

    def __post_init__(self):
        check_fields(self)


@pytest.mark.parametrize("kw,msg", [
    (dict(n=0), "_Knobs.n=0 is invalid: must be an integer >= 1"),
    (dict(n=True), "_Knobs.n=True is invalid: must be an integer >= 1"),
    (dict(n=2.0), "_Knobs.n=2.0 is invalid"),
    (dict(frac=1.0), "_Knobs.frac=1.0 is invalid: must be in (0, 1) (a share)"),
    (dict(frac=float("nan")), "_Knobs.frac=nan is invalid"),
    (dict(kind="c"), "_Knobs.kind='c' is invalid: allowed: a, b"),
    (dict(kind="b", cap=1), "_Knobs.cap=1 is invalid: must be None or an integer >= 2"),
])
def test_declared_rules_name_field_value_and_what_is_allowed(kw, msg):
    with pytest.raises(ConfigError) as err:
        _Knobs(**kw)
    assert str(err.value).startswith(msg), str(err.value)


def test_rules_apply_only_where_they_hold_and_kinds_are_listed():
    _Knobs(kind="a", cap=1)                      # cap's rule holds for kind b only
    _Knobs(kind="b", cap=None)
    assert fields_with(_Knobs, "runtime") == ("chunk",)
    assert require("batch_size", 3, integer=True, min=1) == 3
    with pytest.raises(ConfigError, match=r"^batch_size=0 is invalid: must be an integer >= 1$"):
        require("batch_size", 0, integer=True, min=1)


def test_runtime_fields_come_from_the_model_config_metadata():
    from glm5_jax.train.stages import RUNTIME_FIELDS
    runtime = ModelConfig.runtime_fields()
    assert RUNTIME_FIELDS == runtime
    # the former hand-written lists: the stages' four runtime fields, the --init_from check's fourteen
    assert {"attention_impl", "attn_chunk", "remat", "dsa_short_dense"} <= set(runtime)
    assert {"param_dtype", "dtype", "attention_impl", "attn_chunk", "remat", "scan_layers", "moe_impl",
            "moe_capacity_factor", "moe_round_capacity_factor", "moe_kernel", "moe_token_chunk", "dsa_short_dense",
            "initializer_range", "mtp_depth"} <= set(ModelConfig.same_weights_fields())
    assert not {"num_layers", "attention", "index_topk", "vocab_size", "rope_theta"} & set(ModelConfig.same_weights_fields())


def test_cli_wrapper_maps_the_root_to_one_line_and_status_2(capsys):
    @main_wrapper
    def bad(argv=None):
        raise ConfigError("TrainConfig.steps=0 is invalid: must be an integer >= 1")

    @main_wrapper(also=(OSError,))
    def missing(argv=None):
        raise FileNotFoundError("no such file: x.jsonl")

    @main_wrapper
    def fine(argv=None):
        return 0

    assert bad() == 2 and missing() == 2 and fine() == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: TrainConfig.steps=0 is invalid: must be an integer >= 1", "error: no such file: x.jsonl"]

    @main_wrapper
    def bug(argv=None):
        raise KeyError("a bug keeps its traceback")

    with pytest.raises(KeyError):
        bug()


def _define_demo_flags():
    flags.DEFINE_integer("demo_cli_steps", 3, "an integer flag", lower_bound=1)
    flags.DEFINE_enum("demo_cli_mode", "a", ["a", "b"], "an enum flag")
    flags.DEFINE_string("demo_cli_path", None, "a required flag", required=True)


@main_wrapper
def _demo_main(argv):
    if flags.FLAGS.demo_cli_path == "bad":
        raise ConfigError("demo_cli_path='bad' is invalid: any other path")
    print(flags.FLAGS.demo_cli_steps, flags.FLAGS.demo_cli_mode, argv[1:])
    return 0


@pytest.mark.parametrize("argv,msg", [
    (["--demo_cli_path=p", "--demo_cli_steps=x"], "error: flag --demo_cli_steps=x: invalid literal for int()"),
    (["--demo_cli_path=p", "--demo_cli_steps=0"], "error: flag --demo_cli_steps=0: 0 is not a positive integer"),
    (["--demo_cli_path=p", "--demo_cli_mode=c"], "error: flag --demo_cli_mode=c: value should be one of <a|b>"),
    (["--demo_cli_steps=2"], "error: flag --demo_cli_path=None: Flag --demo_cli_path must have a value"),
    (["--demo_cli_path=p", "--no_such_flag=1"], "error: Unknown command line flag 'no_such_flag'"),
    (["--demo_cli_path=bad"], "error: demo_cli_path='bad' is invalid: any other path"),
])
def test_absl_cli_bad_flag_is_one_line_and_status_2(capsys, argv, msg):
    """glm5_jax.cli's absl entry (run / call): a flag that does not parse, breaks its bound or enum, a
    required flag left out, an unknown flag, and a Glm5Error from main all give one stderr line
    "error: ..." and exit status 2 (what argparse's CLIs gave), never a traceback."""
    assert call(_demo_main, _define_demo_flags, argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith(msg), err


def test_absl_cli_good_flags_reach_main_reset_between_calls(capsys):
    """Flags parse into main (positional arguments passed on); a second call starts from the defaults."""
    assert call(_demo_main, _define_demo_flags, ["--demo_cli_path=p", "--demo_cli_steps=7", "--demo_cli_mode=b", "x"]) == 0
    assert call(_demo_main, _define_demo_flags, ["--demo_cli_path=p"]) == 0
    assert capsys.readouterr().out.splitlines() == ["7 b ['x']", "3 a []"]
