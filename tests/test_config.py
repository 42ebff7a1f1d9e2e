"""Every class of inconsistent ModelConfig fails before tracing, naming the field, value and rule."""

import pytest

from glm5_jax.config import ConfigError, ModelConfig, preset

BAD = [
    (dict(attention="sliding"), "attention", "allowed: mha, gqa, mla, dsa"),
    (dict(attention="gqa", num_heads=4, num_kv_heads=3, indexer_types=None), "num_kv_heads", "divide"),
    (dict(attention="mha", num_heads=4, num_kv_heads=2), "num_kv_heads", "num_kv_heads == num_heads"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim", "even"),
    (dict(attention="gqa", head_dim=9), "head_dim", "even"),
    (dict(qk_rope_head_dim=32, index_head_dim=16), "qk_rope_head_dim", "index_head_dim"),
    (dict(index_topk=0), "index_topk", ">= 1"),
    (dict(experts_per_tok=5, num_experts=4), "experts_per_tok", "num_experts"),
    (dict(num_experts=8, n_group=2, topk_group=3), "topk_group", "n_group"),
    (dict(num_experts=6, n_group=4), "n_group", "divide"),
    (dict(num_experts=8, n_group=2, topk_group=1, experts_per_tok=5), "experts_per_tok", "topk_group"),
    (dict(indexer_types=("shared", "full", "full")), "indexer_types", "must be 'full'"),
    (dict(indexer_types=("full", "full")), "indexer_types", "one entry per layer"),
    (dict(indexer_types=("full", "sparse", "full")), "indexer_types", "allowed: full, shared"),
    (dict(attention="mla", indexer_types=("full", "shared", "full")), "indexer_types", "only meaningful"),
    (dict(d_model=0), "d_model", ">= 1"),
    (dict(first_k_dense=5), "first_k_dense", "num_layers"),
    (dict(mtp_depth=-1), "mtp_depth", ">= 0"),
    (dict(dtype="float8"), "dtype", "allowed"),
    (dict(attention_impl="cuda"), "attention_impl", "xla, pallas"),
    (dict(rope_scaling={"type": "ntk", "factor": 2.0}), "rope_scaling", "type"),
    (dict(num_experts=-1), "num_experts", ">= 0"),
]


@pytest.mark.parametrize("kw,field,rule", BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_config_names_field_value_and_rule(kw, field, rule):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**kw)
    msg = str(err.value)
    assert f"ModelConfig.{field}=" in msg and rule in msg


def test_presets_validate_and_unknown_preset_fails():
    for name in ("tiny", "small", "glm5"):
        preset(name)
    with pytest.raises(ConfigError, match="allowed: tiny, small, glm5"):
        preset("huge")


def test_from_hf_rejects_other_model_types_and_rope_types():
    base = preset("tiny").to_hf()
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_hf({**base, "model_type": "llama"})
    with pytest.raises(ConfigError, match="rope_type"):
        ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})
    scaled = ModelConfig(rope_scaling={"type": "linear", "factor": 4.0})
    assert ModelConfig.from_hf(scaled.to_hf()) == scaled


def test_dotted_overrides_reach_every_model_field():
    """glm5_jax.overrides on a bare ModelConfig: each field parses from its command-line text by
    its declared type, and a combination is judged by validate() once, after all fields are set."""
    from glm5_jax.overrides import OverrideError, all_keys, apply_overrides
    base = preset("glm5")
    text = {bool: lambda v: str(v).lower(), type(None): lambda v: "none", tuple: lambda v: ",".join(map(str, v))}
    items = [f"{k}={text.get(type(getattr(base, k)), str)(getattr(base, k))}" for k in all_keys(base)]
    assert len(items) == len(ModelConfig.__dataclass_fields__)
    assert apply_overrides(base, items) == base
    c = apply_overrides(base, ["num_layers=4", "first_k_dense=1", "indexer_types=full,shared,full,shared",
                               "remat=dots", "scan_layers=false", "rope_scaling=none", "dtype=float32"])
    assert (c.num_layers, c.indexer_types, c.remat, c.scan_layers) == (4, ("full", "shared", "full", "shared"), "dots", False)
    with pytest.raises(ConfigError, match="ModelConfig.first_k_dense=3"):
        apply_overrides(base, ["num_layers=2"])                  # glm5 has 3 dense layers
    with pytest.raises(OverrideError, match="valid keys: .*index_topk"):
        apply_overrides(base, ["index_top_k=8"])
