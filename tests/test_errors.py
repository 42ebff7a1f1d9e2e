"""One error vocabulary (docs/architecture.md, "Errors and validation"): every user-fixable error derives
from Glm5Error, field rules are declared on the config fields and read by one validator, the runtime
field lists come from that metadata, and the CLIs map a Glm5Error to one line and exit status 2."""

import dataclasses

import pytest

from glm5_jax.cli import main_wrapper
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
