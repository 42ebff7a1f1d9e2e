"""ModelConfig: one frozen dataclass for every GLM-5 variant, its presets and HF config interop.

A variant is a field, never a model name: `attention` picks mha | gqa | mla | dsa (dsa = MLA plus
the lightning indexer), `num_experts == 0` makes every layer dense, `mtp_depth == 0` drops MTP.
`validate()` runs in `__post_init__`, so an inconsistent config fails before anything is traced.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from glm5_jax.errors import ConfigError
from glm5_jax.fields import check_fields, fields_with, invalid, setting

ATTENTION_KINDS = ("mha", "gqa", "mla", "dsa")
INDEXER_TYPES = ("full", "shared")
DSA_TOPK_SOURCES = ("indexer", "oracle")     # ModelConfig.dsa_topk_source
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLS = ("xla", "pallas")
MOE_IMPLS = ("ragged", "dense", "a2a")
MOE_KERNELS = ("auto", "megablox", "ragged_dot")   # pallas_kernels.gmm.MOE_KERNELS (the a2a experts' grouped matmul)
ROPE_SCALING_TYPES = ("default", "linear", "yarn")   # rope_scaling None is "default" (glm5_jax.layers.rope)
# Per scaled type: (required keys, optional keys) besides "type", as HF rope_parameters spells them.
ROPE_SCALING_KEYS = {
    "linear": (("factor",), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")),
}
REMAT_POLICIES = ("none", "full", "offload", "dots", "dots_no_batch", "save_qkv", "save_attention", "custom")
# checkpoint names the model tags (glm5_jax.model.remat_policy): what remat_custom may place
REMAT_NAMES = ("decoder_layer_input", "decoder_layer_mid", "attn_q", "attn_kv", "attn_context", "attn_topk", "attn_lse",
               "expert_in", "expert_gate", "expert_up")
REMAT_PLACES = ("device", "offload")


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """One scanned stack of decoder layers: `repeats` copies of a block of `period` layers.

    Every parameter under `params[name]["layer_j"]` (j < period) carries a leading axis of length
    `repeats` (logical name "layers"); block r, sub-layer j is global layer start + r * period + j.
    """
    name: str                                   # dense_layers | moe_layers | <either>_tail
    start: int
    period: int
    repeats: int
    moe: bool
    indexer_types: tuple                        # per sub-layer: "full" | "shared" | None (not dsa)

    def layer_index(self, r: int, j: int) -> int:
        return self.start + r * self.period + j

    @property
    def num_layers(self) -> int:
        return self.period * self.repeats


def _smallest_period(kinds: tuple) -> int:
    for p in range(1, len(kinds) + 1):
        if all(kinds[i] == kinds[i % p] for i in range(len(kinds))):
            return p
    return len(kinds)


def _fail(field: str, value: Any, allowed: str) -> None:
    raise invalid("ModelConfig", field, value, allowed)


def _mla(c) -> bool:
    return c.is_mla


def _not_mla(c) -> bool:
    return not c.is_mla


def _dsa(c) -> bool:
    return c.attention == "dsa"


def _moe(c) -> bool:
    return c.num_experts > 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # Trunk.
    vocab_size: int = setting(256, integer=True, min=1)
    d_model: int = setting(64, integer=True, min=1)
    num_layers: int = setting(3, integer=True, min=1)
    ffn_dim: int = setting(128, integer=True, min=1)   # dense SwiGLU width (HF intermediate_size)
    rms_norm_eps: float = setting(1e-5, gt=0)
    tie_embeddings: bool = False
    initializer_range: float = setting(0.02, runtime=True)   # read only when parameters are initialised
    # Attention.
    attention: str = setting("dsa", choices=ATTENTION_KINDS)   # mha | gqa | mla | dsa
    num_heads: int = setting(4, integer=True, min=1)
    num_kv_heads: int = setting(4, integer=True, min=1, when=_not_mla)   # gqa/mha only
    head_dim: int = setting(16, integer=True, min=1, when=_not_mla)      # gqa/mha only
    q_lora_rank: int = setting(32, integer=True, min=1, when=_mla)       # mla/dsa
    kv_lora_rank: int = setting(32, integer=True, min=1, when=_mla)
    qk_nope_head_dim: int = setting(16, integer=True, min=1, when=_mla)
    qk_rope_head_dim: int = setting(8, integer=True, min=1, when=_mla)
    v_head_dim: int = setting(16, integer=True, min=1, when=_mla)
    # DSA lightning indexer.
    index_topk: int = setting(16, integer=True, min=1, when=_dsa)
    index_n_heads: int = setting(4, integer=True, min=1, when=_dsa)
    index_head_dim: int = setting(16, integer=True, min=1, when=_dsa)
    indexer_types: tuple[str, ...] | None = None   # per layer full | shared; None = all full
    # MoE (num_experts == 0: dense everywhere).
    num_experts: int = setting(4, min=0, note="(0 = dense MLP in every layer)")
    num_shared_experts: int = setting(1, min=0, when=_moe)
    experts_per_tok: int = setting(2, integer=True, min=1, when=_moe)
    moe_ffn_dim: int = setting(32, integer=True, min=1, when=_moe)
    n_group: int = setting(1, integer=True, min=1, when=_moe)
    topk_group: int = setting(1, integer=True, min=1, when=_moe)
    routed_scaling_factor: float = setting(2.5, gt=0, when=_moe)
    norm_topk_prob: bool = True
    first_k_dense: int = 1                # leading layers with a dense MLP
    moe_impl: str = setting("ragged", choices=MOE_IMPLS, same_weights=True)
                                          # ragged (sorted dispatch, dropless) | dense (all experts)
                                          # | a2a (shard_map expert parallelism, glm5_jax.parallel.ep)
    moe_capacity_factor: float = setting(1.25, finite=True, when=_moe, note="(<= 0 means dropless)", same_weights=True)
                                          # a2a only: slots per device pair = cf * n*k/ep; <= 0 = dropless
    moe_round_capacity_factor: float = setting(1.25, finite=True, when=_moe, runtime=True, note=(
        "(> 0: dropless a2a: the first round carries this x the mean pair load; <= 0: one round sized for the worst case)"))
                                          # a2a dropless: slots per device pair in the first all-to-all round = this * n*k/ep,
                                          # overflow rounds after it; <= 0: one round of n*k (worst-case buffers)
    moe_overflow_capacity_factor: float = setting(0.125, finite=True, when=_moe, runtime=True, gt=0, note=(
        "(dropless a2a: slots per device pair in each round after the first, x the mean pair load)"))
                                          # a2a dropless: rounds after the first send the slots past the first round's
                                          # capacity, this * n*k/ep a round (docs/scaleout.md, "Spend the pod")
    moe_kernel: str = setting("auto", choices=MOE_KERNELS, runtime=True)
                                          # a2a only: local experts' grouped matmul: auto (megablox on TPU, ragged_dot
                                          # elsewhere) | megablox (interpret mode on CPU) | ragged_dot (pallas_kernels.gmm)
    moe_token_chunk: int = setting(0, integer=True, min=0, when=_moe, same_weights=True,
                                   note="(0: one dispatch of all of a device's tokens)")
                                          # a2a only: > 0 dispatches each device's tokens in chunks of at most this many (recomputed in the backward)
    # Multi-token prediction.
    mtp_depth: int = setting(1, min=0, note="(0 = no MTP)", same_weights=True)
    mtp_share: bool = True                # one MTP layer reused at every depth (GLM-5)
    reward_head: bool = False             # + a scalar head on the final-normed hidden state (reward model, glm5_jax.rl.reward_model)
    # RoPE.
    rope_theta: float = setting(10000.0, gt=0)
    rope_scaling: tuple[tuple[str, Any], ...] | None = None   # None (default) | e.g. (("factor", 4.0), ("type", "linear")); ROPE_SCALING_KEYS
    # Numerics / implementation. runtime: how the model runs, not what it computes (may change on resume,
    # between stages and against an --init_from checkpoint); same_weights: what it computes changes, what
    # its weights mean does not (a checkpoint of one value starts a run of another). glm5_jax.fields.
    param_dtype: str = setting("float32", choices=DTYPES, same_weights=True)
    dtype: str = setting("float32", choices=DTYPES, same_weights=True)   # compute dtype; softmax, router and norms stay float32
    attention_impl: str = setting("xla", choices=ATTENTION_IMPLS, runtime=True)   # xla | pallas (DSA kernels)
    indexer_impl: str = setting("", choices=("",) + ATTENTION_IMPLS, note="('': as attention_impl)", runtime=True)
                                          # the DSA indexer top-k's kernels alone ('' = attention_impl): the 128K default runs
                                          # the sparse attention in Pallas and the indexer in jnp (docs/scaleout.md)
    attn_chunk: int = setting(256, integer=True, min=1, runtime=True)   # query chunk for attention paths (bounds [chunk, S] memory)
    dsa_short_dense: int = setting(8, integer=True, min=0, note="(0: always the sparse gather)", runtime=True)
                                          # CPU, xla: DSA's sparse stage as top-k-masked dense attention at T <= this * index_topk (0: never)
    dsa_topk_source: str = setting("indexer", choices=DSA_TOPK_SOURCES, note=(
        "(oracle: the top-k of the main attention's own dense softmax, for evaluation)"))
                                          # DSA's k keys: indexer (the lightning indexer) | oracle (top-k of the main
                                          # attention's own head-averaged dense softmax: an evaluation,
                                          # glm5_jax.attention.indexer.oracle_topk)
    dsa_selection_stats: bool = setting(False, runtime=True)
                                          # DSA layers sow per-query attention mass on the selected keys / the
                                          # oracle's and recall (glm5_jax.eval.selection)
    dsa_decode_pages: int = setting(0, integer=True, min=0, when=_dsa, runtime=True, note=(
        "(0: exact token top-k; P > 0: page-level selection, pages of P cache slots; P must divide index_topk)"))
                                          # DSA over a cache (decode, chunked prefill): the exact top-k (0), or the best index_topk / P
                                          # pages of P slots (glm5_jax.attention.indexer.select_topk_cached); training never reads it
    remat: str = setting("none", choices=REMAT_POLICIES, runtime=True)
                                          # none | full (keep layer inputs only) | offload (full, inputs on host) | dots | dots_no_batch
                                          # | save_qkv | save_attention | custom (glm5_jax.model.remat_policy)
    remat_custom: tuple[str, ...] = setting((), runtime=True)
                                          # remat="custom": "NAME:device|offload" per saved name (REMAT_NAMES); the rest is recomputed
    scan_layers: bool = setting(True, runtime=True)   # nn.scan over each layer stack (False: the same stacks unrolled)

    def __post_init__(self):
        if self.indexer_types is not None and not isinstance(self.indexer_types, tuple):
            object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
        if self.indexer_types is not None and set(self.indexer_types) == {"full"} \
                and len(self.indexer_types) == self.num_layers:
            object.__setattr__(self, "indexer_types", None)    # canonical form of "every layer full"
        if isinstance(self.remat_custom, (list, str)):
            rc = self.remat_custom
            object.__setattr__(self, "remat_custom", tuple(x for x in (rc.split(",") if isinstance(rc, str) else rc) if x))
        if isinstance(self.remat, bool):                        # the first version's on/off switch
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        object.__setattr__(self, "rope_scaling", _canonical_rope_scaling(self.rope_scaling))
        self.validate()

    # ----------------------------------------------------------------- derived
    @property
    def is_mla(self) -> bool:
        return self.attention in ("mla", "dsa")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def layer_indexer_types(self) -> tuple[str, ...]:
        if self.attention != "dsa":
            return ()
        return self.indexer_types or ("full",) * self.num_layers

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense

    @property
    def layer_stacks(self) -> tuple[LayerStack, ...]:
        """The decoder as scanned stacks: the dense prefix, then the MoE body; each is the shortest
        repeating block of (indexer type) layouts, plus a `_tail` stack for a partial last block."""
        types = self.layer_indexer_types or (None,) * self.num_layers
        n_dense = self.first_k_dense if self.num_experts > 0 else self.num_layers
        stacks = []
        for name, lo, hi, moe in (("dense_layers", 0, n_dense, False), ("moe_layers", n_dense, self.num_layers, True)):
            kinds = tuple(types[lo:hi])
            if not kinds:
                continue
            p = _smallest_period(kinds)
            reps, rem = divmod(len(kinds), p)
            stacks.append(LayerStack(name, lo, p, reps, moe, kinds[:p]))
            if rem:
                stacks.append(LayerStack(f"{name}_tail", lo + reps * p, rem, 1, moe, kinds[:rem]))
        return tuple(stacks)

    @property
    def rope_scaling_dict(self) -> dict:
        return dict(self.rope_scaling or ())

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    @classmethod
    def runtime_fields(cls) -> tuple[str, ...]:
        """How the model runs, not what it computes: may change on resume and between stages."""
        return fields_with(cls, "runtime")

    @classmethod
    def same_weights_fields(cls) -> tuple[str, ...]:
        """What a checkpoint of another value of these still means to this config: the runtime fields and
        those that change the computation but not the weights (dtypes, MoE dispatch, MTP depth)."""
        return fields_with(cls, "runtime") + fields_with(cls, "same_weights")

    # ----------------------------------------------------------------- validation
    def validate(self) -> None:
        """The declared field rules (glm5_jax.fields.check_fields), then the rules over several fields."""
        check_fields(self)
        for item in self.remat_custom:
            name, _, place = str(item).partition(":")
            if name not in REMAT_NAMES or place not in REMAT_PLACES:
                _fail("remat_custom", item, f"entries are NAME:PLACE with NAME in {', '.join(REMAT_NAMES)} and "
                      f"PLACE in {', '.join(REMAT_PLACES)}")
        if self.remat_custom and self.remat != "custom":
            _fail("remat_custom", self.remat_custom, "is only read with remat='custom'")
        if not isinstance(self.dsa_selection_stats, bool):
            _fail("dsa_selection_stats", self.dsa_selection_stats, "must be a bool")
        if self.attention == "dsa" and self.dsa_decode_pages and self.index_topk % self.dsa_decode_pages:
            _fail("dsa_decode_pages", self.dsa_decode_pages, f"must divide index_topk={self.index_topk} (or be 0: exact top-k)")
        if self.attention == "mha" and self.num_kv_heads != self.num_heads:
            _fail("num_kv_heads", self.num_kv_heads, f"mha needs num_kv_heads == num_heads ({self.num_heads}); use attention='gqa'")
        if self.attention == "gqa" and self.num_heads % self.num_kv_heads:
            _fail("num_kv_heads", self.num_kv_heads, f"must divide num_heads={self.num_heads}")
        rope_dim = self.qk_rope_head_dim if self.is_mla else self.head_dim
        rope_field = "qk_rope_head_dim" if self.is_mla else "head_dim"
        if rope_dim % 2:
            _fail(rope_field, rope_dim, "RoPE rotates pairs, so the rope dim must be even")
        if self.attention == "dsa":
            if self.qk_rope_head_dim > self.index_head_dim:
                _fail("qk_rope_head_dim", self.qk_rope_head_dim,
                      f"the indexer applies RoPE to its first qk_rope_head_dim dims, so it must be <= index_head_dim={self.index_head_dim}")
            types = self.layer_indexer_types
            if len(types) != self.num_layers:
                _fail("indexer_types", self.indexer_types, f"needs one entry per layer (num_layers={self.num_layers})")
            for i, t in enumerate(types):
                if t not in INDEXER_TYPES:
                    _fail("indexer_types", self.indexer_types, f"entry {i} is {t!r}; allowed: full, shared")
            if types[0] != "full":
                _fail("indexer_types", self.indexer_types, "layer 0 is 'shared' but a shared layer reuses the previous "
                      "full layer's indices, so layer 0 must be 'full'")
        elif self.indexer_types is not None:
            _fail("indexer_types", self.indexer_types, f"only meaningful with attention='dsa' (got attention={self.attention!r}); set it to None")
        if self.num_experts > 0:
            if self.experts_per_tok > self.num_experts:
                _fail("experts_per_tok", self.experts_per_tok, f"must be <= num_experts={self.num_experts}")
            if self.num_experts % self.n_group:
                _fail("n_group", self.n_group, f"must divide num_experts={self.num_experts}")
            if self.topk_group > self.n_group:
                _fail("topk_group", self.topk_group, f"must be <= n_group={self.n_group}")
            per_group = self.num_experts // self.n_group
            if self.n_group > 1 and per_group < 2:
                _fail("n_group", self.n_group, "group scores sum each group's top-2 experts, so every group needs >= 2 experts")
            if self.experts_per_tok > self.topk_group * per_group:
                _fail("experts_per_tok", self.experts_per_tok,
                      f"must be <= topk_group * experts per group = {self.topk_group * per_group}")
        if not 0 <= self.first_k_dense <= self.num_layers:
            _fail("first_k_dense", self.first_k_dense, f"must be in [0, num_layers={self.num_layers}]")
        if self.rope_scaling is not None:
            _validate_rope_scaling(self.rope_scaling_dict)

    # ----------------------------------------------------------------- HF interop
    @classmethod
    def from_hf(cls, source: str | os.PathLike | Mapping[str, Any], **overrides) -> "ModelConfig":
        """From a HF `config.json` (path to the file or its folder) or its dict (model_type glm_moe_dsa)."""
        if isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.exists(path):
                raise FileNotFoundError(f"no HF config at {path}")
            with open(path) as f:
                hf = json.load(f)
        else:
            hf = dict(source)
        mt = hf.get("model_type", "glm_moe_dsa")
        if mt not in ("glm_moe_dsa", "glm5_jax"):
            raise ConfigError(f"config.json model_type={mt!r} is not supported; expected 'glm_moe_dsa'")
        theta, scaling = rope_from_hf(hf)
        n_layers = hf["num_hidden_layers"]
        first_dense = hf.get("first_k_dense_replace", 3)
        mlp_types = hf.get("mlp_layer_types")
        if mlp_types is not None:
            n_dense = sum(1 for t in mlp_types if t == "dense")
            if list(mlp_types) != ["dense"] * n_dense + ["sparse"] * (len(mlp_types) - n_dense):
                raise ConfigError(f"mlp_layer_types={mlp_types} is not supported: dense layers must all lead")
            first_dense = n_dense
        attention = hf.get("glm5_jax_attention", "dsa")
        kw = dict(
            vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=n_layers,
            ffn_dim=hf["intermediate_size"], rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=hf.get("initializer_range", 0.02),
            attention=attention, num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            head_dim=hf.get("glm5_jax_head_dim", 16),
            q_lora_rank=hf["q_lora_rank"], kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"], index_topk=hf.get("index_topk", 2048),
            index_n_heads=hf.get("index_n_heads", 32), index_head_dim=hf.get("index_head_dim", 128),
            indexer_types=tuple(hf["indexer_types"]) if (hf.get("indexer_types") and attention == "dsa") else None,
            num_experts=hf.get("n_routed_experts", 0), num_shared_experts=hf.get("n_shared_experts", 0),
            experts_per_tok=hf.get("num_experts_per_tok", 1), moe_ffn_dim=hf.get("moe_intermediate_size", 1),
            n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
            routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)), first_k_dense=first_dense,
            mtp_depth=hf.get("glm5_jax_mtp_depth", hf.get("num_nextn_predict_layers", 0)), mtp_share=bool(hf.get("glm5_jax_mtp_share", True)),
            rope_theta=float(theta), rope_scaling=scaling, reward_head=bool(hf.get("glm5_jax_reward_head", False)),
        )
        if attention in ("mha", "gqa"):
            kw.update(indexer_types=None)
        kw.update(overrides)
        return cls(**kw)

    def to_hf(self) -> dict:
        """The HF `config.json` dict (model_type glm_moe_dsa). Non-HF variants keep glm5_jax_* keys."""
        rope = rope_to_hf(self.rope_theta, self.rope_scaling_dict)
        hf = {
            "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
            "vocab_size": self.vocab_size, "hidden_size": self.d_model, "num_hidden_layers": self.num_layers,
            "intermediate_size": self.ffn_dim, "moe_intermediate_size": self.moe_ffn_dim,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads if not self.is_mla else self.num_heads,
            "n_shared_experts": self.num_shared_experts, "n_routed_experts": self.num_experts,
            "routed_scaling_factor": self.routed_scaling_factor, "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank, "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim, "qk_nope_head_dim": self.qk_nope_head_dim,
            "n_group": self.n_group, "topk_group": self.topk_group,
            "num_experts_per_tok": self.experts_per_tok, "norm_topk_prob": self.norm_topk_prob,
            "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps, "rope_parameters": rope,
            "index_topk": self.index_topk, "index_head_dim": self.index_head_dim,
            "index_n_heads": self.index_n_heads, "first_k_dense_replace": self.first_k_dense,
            "mlp_layer_types": ["sparse" if self.is_moe_layer(i) else "dense" for i in range(self.num_layers)],
            "tie_word_embeddings": self.tie_embeddings, "initializer_range": self.initializer_range,
            "num_nextn_predict_layers": self.mtp_depth if not self.mtp_share else min(self.mtp_depth, 1),
            "attention_bias": False, "torch_dtype": self.param_dtype,
        }
        if rope["rope_type"] == "yarn":   # HF: the post-YaRN length, factor x the original
            hf["max_position_embeddings"] = int(round(rope["factor"] * rope["original_max_position_embeddings"]))
        if self.attention == "dsa":
            hf["indexer_types"] = list(self.layer_indexer_types)
        if self.attention != "dsa":
            hf["glm5_jax_attention"] = self.attention
            hf["glm5_jax_head_dim"] = self.head_dim
        if self.mtp_depth:
            hf["glm5_jax_mtp_share"] = self.mtp_share
            hf["glm5_jax_mtp_depth"] = self.mtp_depth
        if self.reward_head:
            hf["glm5_jax_reward_head"] = True
        return hf


# ----------------------------------------------------------------------------- RoPE scaling
def _canonical_rope_scaling(value):
    """rope_scaling as stored: None for plain RoPE, else a sorted tuple of (key, value) items with
    the type under "type" (HF's "rope_type" is accepted for it) and None-valued keys dropped."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        items = dict(value)
    else:
        try:
            items = dict(value)
        except (TypeError, ValueError):
            _fail("rope_scaling", value, "must be None or a mapping / (key, value) pairs, e.g. {'type': 'linear', 'factor': 4.0}")
    if "rope_type" in items:
        kind = items.pop("rope_type")
        if items.setdefault("type", kind) != kind:
            _fail("rope_scaling", value, "'type' and 'rope_type' disagree")
    items = {k: v for k, v in items.items() if v is not None}
    if items.get("type") == "default" and len(items) == 1:
        return None                                   # {"type": "default"} is plain RoPE
    return tuple(sorted(items.items()))


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _validate_rope_scaling(rs: dict) -> None:
    kind = rs.get("type")
    if kind not in ROPE_SCALING_KEYS:
        _fail("rope_scaling", rs, f"'type' must be one of {ROPE_SCALING_TYPES} "
              f"('default' = plain RoPE with rope_theta, no other keys)")
    required, optional = ROPE_SCALING_KEYS[kind]
    missing = [k for k in required if k not in rs]
    if missing:
        _fail("rope_scaling", rs, f"type {kind!r} needs keys {list(required)}; missing {missing}")
    unknown = sorted(set(rs) - {"type", *required, *optional})
    if unknown:
        _fail("rope_scaling", rs, f"unknown key(s) {unknown} for type {kind!r}; allowed: {list(required + optional)}")
    if not (_is_number(rs["factor"]) and rs["factor"] > 0):
        _fail("rope_scaling", rs, "'factor' must be a number > 0")
    if kind != "yarn":
        return
    omax = rs["original_max_position_embeddings"]
    if isinstance(omax, bool) or not isinstance(omax, int) or omax < 1:
        _fail("rope_scaling", rs, "'original_max_position_embeddings' must be an integer >= 1 (the pre-extension context)")
    for k in ("beta_fast", "beta_slow", "attention_factor"):
        if k in rs and not (_is_number(rs[k]) and rs[k] > 0):
            _fail("rope_scaling", rs, f"{k!r} must be a number > 0")
    if rs.get("beta_fast", 32) < rs.get("beta_slow", 1):
        _fail("rope_scaling", rs, "'beta_fast' (default 32) must be >= 'beta_slow' (default 1)")
    for k in ("mscale", "mscale_all_dim"):
        if k in rs and not (_is_number(rs[k]) and rs[k] >= 0):
            _fail("rope_scaling", rs, f"{k!r} must be a number >= 0")
    if "truncate" in rs and not isinstance(rs["truncate"], bool):
        _fail("rope_scaling", rs, "'truncate' must be true or false")


def rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling dict or None) from a HF config.json dict, read as transformers
    reads it: `rope_scaling` (older spelling) before `rope_parameters`, "type" for "rope_type",
    rope_theta inside that dict or top-level; yarn's original_max_position_embeddings from a
    top-level key first, else the dict, else max_position_embeddings; a null factor is
    max_position_embeddings / original_max_position_embeddings."""
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0)
    kind = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    prf = rope.pop("partial_rotary_factor", None)
    if prf not in (None, 1, 1.0):
        raise ConfigError(f"rope partial_rotary_factor={prf!r} is not supported (GLM-5 rotates the whole rope slice)")
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALING_KEYS:
        raise ConfigError(f"rope_parameters.rope_type={kind!r} is not supported; allowed: {', '.join(ROPE_SCALING_TYPES)}")
    if kind == "yarn":
        if hf.get("original_max_position_embeddings") is not None:
            rope["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        rope.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 202752))
        if rope.get("factor") is None and hf.get("max_position_embeddings"):
            rope["factor"] = hf["max_position_embeddings"] / rope["original_max_position_embeddings"]
    scaling = {"type": kind, **{k: v for k, v in rope.items() if v is not None}}
    if _is_number(scaling.get("factor")):
        scaling["factor"] = float(scaling["factor"])
    return theta, scaling


def rope_to_hf(theta: float, scaling: Mapping[str, Any] | None) -> dict:
    """HF config.json `rope_parameters` for rope_theta + a rope_scaling dict (inverse of rope_from_hf)."""
    rope = {"rope_type": "default", "rope_theta": theta}
    if scaling:
        rope.update({k: v for k, v in scaling.items() if k != "type"}, rope_type=scaling["type"])
    return rope


# ----------------------------------------------------------------------------- presets
def _tiny() -> ModelConfig:
    return ModelConfig()


def _small() -> ModelConfig:
    # ~0.25B total parameters (~0.11B active), one accelerator.
    return ModelConfig(
        vocab_size=32768, d_model=768, num_layers=12, ffn_dim=2048, attention="dsa", num_heads=12,
        q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        index_topk=512, index_n_heads=4, index_head_dim=64, num_experts=12, num_shared_experts=1,
        experts_per_tok=2, moe_ffn_dim=512, first_k_dense=1, mtp_depth=1, rope_theta=10000.0,
        param_dtype="float32", dtype="bfloat16", attn_chunk=512)


def _glm5() -> ModelConfig:
    # zai-org/GLM-5 as released (HF GlmMoeDsaConfig defaults + rope theta 1e6).
    return ModelConfig(
        vocab_size=154880, d_model=6144, num_layers=78, ffn_dim=12288, attention="dsa", num_heads=64,
        num_kv_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
        v_head_dim=256, index_topk=2048, index_n_heads=32, index_head_dim=128, num_experts=256,
        num_shared_experts=1, experts_per_tok=8, moe_ffn_dim=2048, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense=3, mtp_depth=3, mtp_share=True,
        rope_theta=1e6, param_dtype="bfloat16", dtype="bfloat16", attn_chunk=1024)


PRESETS = {"tiny": _tiny, "small": _small, "glm5": _glm5}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
    cfg = PRESETS[name]()
    return cfg.replace(**overrides) if overrides else cfg
