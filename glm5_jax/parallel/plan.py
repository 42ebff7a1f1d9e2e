"""Per-device memory plan of the train step for any mesh, without the devices.

Parameters and optimizer state: exact, from sharded abstract shapes. `jax.eval_shape` of the model's
init and of `tx.init` gives every leaf's shape and dtype (nothing is allocated); the logical sharding
rules give its PartitionSpec on a `jax.sharding.AbstractMesh` of the requested sizes; the per-device
bytes are the shard shape (dims divided by the product of their mesh axes, rounded up) times the
itemsize, summed.

Activations: measured when the mesh's devices exist here (small presets; on CPU tools/plan.py forces
that many host devices): the train step is lowered with ShapeDtypeStructs carrying the shardings and
compiled; `compiled.memory_analysis().temp_size_in_bytes` is the per-device scratch (activations kept
for the backward pass plus workspace). Otherwise (glm5 on a pod mesh) they are estimated
analytically, see `estimate_activation_bytes`, plus one param-sized gradient tree. The compiled
figure for a TPU topology comes from `python -m tools.aot` (the TPU compiler, no TPU, ~26 min for
glm5 on 2 CPU cores); for glm5 on v5p:4x4x8 at 4K the estimate is below it by x1.11-1.15
(docs/scaleout.md). The estimate is a lower bound: on the tiny preset (data:2,expert:2, batch
8 x 64) XLA's measured scratch was 17.2 MB against 3.8 MB estimated at 5e66785 (small dims: workspace, fusion
temporaries and optimizer-update buffers dominate); at glm5 scale the per-token terms dominate.

The mesh's `context` axis (context parallelism) splits every sequence: a device holds seq/context
tokens of each of its sequences (per-token terms shrink by context), while attention reads the keys
of the whole sequence (key terms use the full seq_len). Parameters need no special case: `context`
joins fsdp in the logical rules, so the sharded abstract shapes already divide by it.
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
import numpy as np

from glm5_jax.chips import CHIPS
from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.sharding import MESH_AXES, check_model_fits_mesh, parse_mesh_spec
from glm5_jax.train.config import TrainConfig

# the memory targets a plan is checked against: name -> bytes per device (glm5_jax.chips, binary units)
TARGETS = {c.label: c.hbm_bytes for c in (CHIPS["v5p"], CHIPS["H200"])}
# ModelConfig.remat policy -> the estimate's formula. "full" keeps only each layer's input ("layer");
# the dots policies keep every matmul output, which is most of a layer's saved values, so they are
# estimated with the no-remat formula (an upper bound for them). "offload" is "full" with the scanned
# layers' inputs in host memory ("layer_offload": the layer formula without them; host bytes reported).
ESTIMATE_MODE = {"none": "none", "full": "layer", "offload": "layer_offload", "dots": "none", "dots_no_batch": "none",
                 # named-activation policies: estimated as "full" (the saved names are not counted: a lower bound)
                 "save_qkv": "layer", "save_attention": "layer", "custom": "layer"}
_DT = {"float32": 4, "bfloat16": 2, "float16": 2}
_TILE_BYTES = 4 * 2 ** 20   # the reference kernels' cache-sized tile bound (pallas_kernels.dsa_xla)


def abstract_mesh(sizes: Mapping[str, int]):
    return jax.sharding.AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                                     axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def estimate_activation_bytes(cfg: ModelConfig, batch_size: int, seq_len: int, sizes: Mapping[str, int],
                              remat: str = "none", logits_chunk: int = 0) -> dict:
    """Analytic per-device activation bytes of one train step (an estimate, not a measurement).

    Tokens and keys. The batch is split over data*fsdp*expert and each sequence over `context`
    (2*context chunks, device i holding chunks i and 2*context-1-i): a device holds
    b = ceil(batch / (data*fsdp*expert)) sequences of T = seq/context tokens, n = b*T tokens. Attention
    sees every key of its sequences: S = seq keys (all-gathered along `context` when it is > 1).
    H_l = ceil(heads / tensor); c = compute dtype bytes; f = 4 (float32: router, softmax statistics,
    scores, logits); K = min(S, index_topk).

    Per token and decoder layer, the forward values the backward pass needs:
      attention, MLA expanded (attention=mla: k / v per head)
                 c*(q_lora + 2*H_l*qk_head [q, roped q] + kv_lora + rope + H_l*(qk_nope + v_head) [k, v]
                   + H_l*v_head [out]) + f*H_l [log-sum-exp]
      attention, DSA (MQA form: one [kv_latent | k_rope] row per key serves every head)
                 c*(q_lora + 2*H_l*qk_head + kv_lora + rope + H_l*(kv_lora + rope) [absorbed q]
                   + H_l*kv_lora [latent output] + H_l*v_head [out]) + f*H_l [log-sum-exp]
      attention, mha / gqa   c*(2*H_l*head [q, roped q] + 2*ceil(kv_heads/tensor)*head [k, v]
                   + H_l*head [out]) + f*H_l
      indexer    (dsa) c*(index_heads*index_dim + index_dim) [q_I, k_I] + f*index_heads [weights]
                 + 4*K [the int32 top-k indices, the one indexer output a layer keeps]
      moe layer  2*f*E [router] + 2*c*k*D [dispatched x, expert y] + 3*c*k*ceil(F_moe/tensor) [gate, up,
                 act] + 3*c*ceil(F_moe*shared/tensor);   dense layer 3*c*ceil(ffn/tensor)
      norms      4*c*D (two norm inputs, two residual sums)
    logits       f*ceil(V/tensor)*(1 + mtp_depth) [stacked logits] + 2*f*ceil(V/tensor) [softmax, grad]
    Attention scores and probabilities are NOT per-token terms: every attention path (the jnp flash
    kernel, the sparse MQA kernel, the indexer top-k) works query chunk by query chunk and keeps
    only the output and its log-sum-exp (custom VJPs; the indexer's top-k gets no gradient), so
    [queries x keys] float32 arrays exist one chunk at a time. Counting 2*f*H_l*K (and, for the
    indexer, 2*f*S) per token, as this formula did before the context axis, charged every token's
    score row at once: 1 MiB per token for glm5, 16 GiB per layer at 16K tokens per device that no
    compiled program holds. They enter instead as one transient tile (counted once, the larger of the two):
      score tile  dense: 2*f*b*H_l*B_q*B_k, B_q = B_k = min(attn_chunk, T_q) (flash blocks; T_q = T, or
                  T/2 with context > 1, where the kernels run once per local chunk);
                  DSA: 2*f*b*H_l*r*K, r = the sparse kernel's query rows (<= min(16, attn_chunk), its
                  gathered [r, K, kv_lora + rope] float32 tile under 4 MiB)
      index tile  (dsa) f*b*r_I*S*(index_heads + 2) [the [r_I, index_heads, S] dot, the weighted
                  scores, their sort keys], r_I = min(attn_chunk, max(32, 4 MiB / (4*b*index_heads*S)))
                  as pallas_kernels.dsa_xla.indexer_topk picks it.
    Terms that scale with the number of KEYS use S (the full sequence), per layer and sequence held,
    times b (context > 1 only: with context = 1 the keys are the local tokens' own, per-token terms):
      gathered keys        DSA and absorbed MLA: c*(kv_lora + rope)*S (one MQA key row per key, an
                           attention residual: its gradient is S rows too); MLA expanded:
                           c*H_l*(qk_head + v_head)*S (per-head K and V); mha / gqa: 2*c*ceil(kv_heads/tensor)*head*S
      gathered index keys  (dsa) c*index_dim*S: read by the top-k only (no gradient), so transient.

    remat="none" (no rematerialisation): every layer's values live at once, each layer keeping its
      gathered keys as an attention residual:
      n * (sum over L layers + mtp_depth MTP layers of per-layer bytes) + (L + mtp_depth) * gathered keys
      + gathered index keys + tile + n * logits.
    remat="layer" (checkpoint each decoder layer): only layer inputs are kept, one layer is recomputed
      (its gathered keys live only during that layer's recompute and backward: counted once):
      n * c * D * (L + mtp_depth) + 2 * (n * max per-layer bytes + gathered keys) [its values and their
      gradients] + gathered index keys + tile + n * logits.
    remat="layer_offload" (ModelConfig.remat="offload"): as "layer", but the n * c * D * L inputs of the
      L scanned layers live in host memory (reported as host_bytes); the MTP layers' inputs stay.
    All add 4 x one MoE layer's routed-expert weights as a device holds them inside the a2a dispatch
    (E/expert experts, all-gathered over fsdp x context: 3 * E/expert * D * ceil(F_moe/tensor) * c): the
    gathered copy, the copy the backward recomputes with, its gradient before the reduce-scatter and the
    gradient's accumulation. The compiled glm5 step shows exactly these four per layer (tools.aot,
    docs/scaleout.md); they are per-token-independent, so they dominate at small batch per device.
    All add 3*c*V*D for the vocabulary tables held whole (embedding table gathered for the lookup, its
    scatter-add gradient, the gathered LM-head kernel).
    All also add the LM-head kernel's gradient as one float32 [D, ceil(V/tensor)] buffer, f*D*ceil(V/tensor),
    summed over the main and MTP heads before its reduce-scatter over the batch axes (the compiled
    glm5 step holds it at its peak, 3.5 GiB: docs/scaleout.md).
    ModelConfig.moe_token_chunk > 0 (a2a, fewer than n tokens a chunk): the dispatch terms
    (2*c*k*D + 3*c*k*ceil(F_moe/tensor) per token) count for one chunk, with its gradient, instead of n.
    logits_chunk > 0 (TrainConfig.logits_chunk: the head and cross-entropy per chunk of that many
    tokens of each sequence shard, recomputed in the backward): no per-token logits term; instead one
    chunk's float32 logits, softmax and gradient, 3*f*b*min(chunk, T)*ceil(V/tensor), per-token-independent.
    The planner assumes DSA's sparse stage (TrainConfig.indexer_loss None or "sparse"); the dense
    warm-up (indexer_loss="dense") runs expanded MLA and a dense KL, not estimated here.
    """
    shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    tp, cp = sizes["tensor"], sizes.get("context", 1)
    seqs = math.ceil(batch_size / shards)
    t_loc = math.ceil(seq_len / cp)
    n = seqs * t_loc
    c, f = _DT[cfg.dtype], 4
    d = cfg.d_model
    hl = math.ceil(cfg.num_heads / tp)
    dsa = cfg.attention == "dsa"
    keys = min(seq_len, cfg.index_topk) if dsa else seq_len
    t_q = t_loc // 2 if cp > 1 else t_loc      # queries per kernel call: each of a device's two chunks
    block = min(cfg.attn_chunk, t_q)
    if cfg.is_mla:
        row = cfg.kv_lora_rank + cfg.qk_rope_head_dim             # one MQA key row
        attn = c * (cfg.q_lora_rank + 2 * hl * cfg.qk_head_dim + row + hl * cfg.v_head_dim)
        if dsa:
            attn += c * (hl * row + hl * cfg.kv_lora_rank)
            gathered_keys = c * row * seq_len
            rows = max(1, min(16, cfg.attn_chunk, _TILE_BYTES // (keys * row * f)))
            score_tile = 2 * f * seqs * hl * rows * keys
        else:
            attn += c * hl * (cfg.qk_nope_head_dim + cfg.v_head_dim)
            gathered_keys = c * hl * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len
            score_tile = 2 * f * seqs * hl * block * block
    else:
        kvl = math.ceil(cfg.num_kv_heads / tp)
        attn = c * (2 * hl * cfg.head_dim + 2 * kvl * cfg.head_dim + hl * cfg.head_dim)
        gathered_keys = 2 * c * kvl * cfg.head_dim * seq_len
        score_tile = 2 * f * seqs * hl * block * block
    attn += f * hl
    gathered_keys = seqs * gathered_keys if cp > 1 else 0
    idx, index_tile, gathered_index_keys = 0, 0, 0
    if dsa:
        hi = cfg.index_n_heads
        gathered_index_keys = seqs * c * cfg.index_head_dim * seq_len if cp > 1 else 0
        idx = c * (hi * cfg.index_head_dim + cfg.index_head_dim) + f * hi + 4 * keys
        r_i = min(cfg.attn_chunk, t_q, max(32, _TILE_BYTES // (f * seqs * hi * seq_len)))
        index_tile = f * seqs * r_i * seq_len * (hi + 2)
    dispatch = (2 * c * cfg.experts_per_tok * d + 3 * c * cfg.experts_per_tok * math.ceil(cfg.moe_ffn_dim / tp)
                if cfg.num_experts else 0)          # per dispatched token: slots out and back, expert activations
    moe = (2 * f * cfg.num_experts + 3 * c * math.ceil(cfg.moe_ffn_dim * cfg.num_shared_experts / tp)
           if cfg.num_experts else 0)
    dispatch_block = 0
    if cfg.moe_token_chunk and cfg.moe_impl == "a2a" and cfg.moe_token_chunk < n:
        # ModelConfig.moe_token_chunk: the dispatch of one chunk (and its gradient) lives at once
        dispatch_block = 2 * dispatch * cfg.moe_token_chunk
    else:
        moe += dispatch
    dense = 3 * c * math.ceil(cfg.ffn_dim / tp)
    norms = 4 * c * d
    per_layer = [attn + idx + (moe if cfg.is_moe_layer(i) else dense) + norms for i in range(cfg.num_layers)]
    per_layer += [attn + idx + (moe if cfg.num_experts else dense) + norms + 3 * c * d] * cfg.mtp_depth
    vl = math.ceil(cfg.vocab_size / tp)
    logits = f * vl * (1 + cfg.mtp_depth) + 2 * f * vl
    logits_block = 0
    if logits_chunk:
        logits, logits_block = 0, 3 * f * seqs * min(logits_chunk, t_loc) * vl
    tile = max(score_tile, index_tile, logits_block)
    gathered = (4 * 3 * math.ceil(cfg.num_experts / sizes["expert"]) * d * math.ceil(cfg.moe_ffn_dim / tp) * c
                if cfg.num_experts else 0)
    head_grad = f * d * vl
    # the vocabulary tables as a chip holds them whole: the embedding table all-gathered for the lookup,
    # its scatter-add gradient before the reduce-scatter, the LM-head kernel all-gathered (the compiled
    # glm5 128K step shows these bf16 [V, D] buffers, 1.77 GiB each: docs/scaleout.md)
    tables = 3 * c * cfg.vocab_size * d
    fixed = tile + gathered + head_grad + dispatch_block + tables     # per-token-independent
    if remat == "none":
        total = n * sum(per_layer) + len(per_layer) * gathered_keys + gathered_index_keys + n * logits + fixed
    elif remat in ("layer", "layer_offload"):
        saved = cfg.num_layers if remat == "layer" else 0       # scanned layers' inputs kept on the device
        total = (n * c * d * (saved + cfg.mtp_depth) + 2 * (n * max(per_layer) + gathered_keys)
                 + gathered_index_keys + n * logits + fixed)
    else:
        raise ConfigError(f"remat={remat!r}: allowed none, layer, layer_offload")
    host = n * c * d * cfg.num_layers if remat == "layer_offload" else 0
    return {"bytes": int(total), "tokens_per_device": n, "sequences_per_device": seqs, "keys_per_sequence": seq_len,
            "per_token_layer_bytes_max": int(max(per_layer)), "logits_bytes_per_token": int(logits),
            "gathered_key_bytes_per_layer": int(gathered_keys), "gathered_index_key_bytes": int(gathered_index_keys),
            "score_tile_bytes": int(tile), "logits_chunk_bytes": int(logits_block),
            "moe_dispatch_chunk_bytes": int(dispatch_block),
            "gathered_expert_weight_bytes": int(gathered), "head_gradient_bytes": int(head_grad),
            "vocab_table_bytes": int(tables), "host_bytes": int(host), "remat": remat}


def _fits(total: int) -> dict:
    return {name: bool(total <= cap) for name, cap in TARGETS.items()}


def plan(cfg: ModelConfig, mesh: str | Mapping[str, int], *, batch_size: int | None = None, seq_len: int = 4096,
         optimizer: str = "adamw", activations: str = "auto", preset_name: str | None = None,
         logits_chunk: int = 0) -> dict:
    """Per-device bytes of params / optimizer state / activations of the train step on `mesh`.

    activations: auto (measure if the mesh's devices exist and the model has < 5e9 parameters, else
    estimate) | measure | estimate.
    """
    from glm5_jax.sharding import make_mesh
    from glm5_jax.train.state import abstract_batch, abstract_state, per_device_bytes
    from glm5_jax.train.step import make_train_step

    sizes = parse_mesh_spec(mesh)
    if any(v == -1 for v in sizes.values()):
        raise ConfigError(f"mesh {sizes}: the planner needs explicit sizes (no -1)")
    n_dev = math.prod(sizes.values())
    shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    batch_size = shards if batch_size is None else batch_size
    check_model_fits_mesh(cfg, sizes, batch_size, seq_len)
    tcfg = TrainConfig(batch_size=batch_size, seq_len=seq_len, optimizer=optimizer, steps=1000,
                       logits_chunk=logits_chunk)
    amesh = abstract_mesh(sizes)
    state, tx = abstract_state(cfg, tcfg, amesh)
    p_bytes = per_device_bytes(state["params"])
    o_bytes = per_device_bytes(state["opt_state"])
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(state["params"]))
    modes = ("none", "layer") + (("layer_offload",) if cfg.remat == "offload" else ())
    est = {r: estimate_activation_bytes(cfg, batch_size, seq_len, sizes, r, logits_chunk) for r in modes}
    for e in est.values():         # the gradient tree (param-sized) is scratch too, as in the measured figure
        e["gradient_bytes"] = p_bytes
        e["bytes"] += p_bytes
    measure = activations == "measure" or (activations == "auto" and n_params < 5e9 and len(jax.devices()) >= n_dev)
    if activations == "measure" and len(jax.devices()) < n_dev:
        raise ConfigError(f"--activations=measure needs {n_dev} devices, {len(jax.devices())} exist")
    sources = {"params": "exact: sharded abstract shapes (jax.eval_shape + logical sharding rules)",
               "optimizer": "exact: jax.eval_shape(tx.init) with mirrored parameter shardings"}
    out = {"preset": preset_name, "mesh": sizes, "devices": n_dev, "batch_size": batch_size, "seq_len": seq_len,
           "optimizer": optimizer, "num_params": n_params}
    if measure:
        real = make_mesh(sizes, jax.devices()[:n_dev])
        rstate, _ = abstract_state(cfg, tcfg, real, tx)
        step = make_train_step(cfg, tcfg, tx, real)          # the step every experiment runs
        compiled = step.lower(rstate, abstract_batch(batch_size, seq_len, real)).compile()
        ma = compiled.memory_analysis()
        a_bytes = int(ma.temp_size_in_bytes)
        sources["activations"] = ("measured: compiled.memory_analysis().temp_size_in_bytes "
                                  f"(remat={cfg.remat})")
        out["compiled_memory_analysis"] = {k: int(getattr(ma, k)) for k in (
            "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
            "generated_code_size_in_bytes") if hasattr(ma, k)}
    else:
        mode = ESTIMATE_MODE[cfg.remat]
        a_bytes = est[mode]["bytes"]
        sources["activations"] = (f"estimated: estimate_activation_bytes(remat='{mode}') "
                                  f"(ModelConfig.remat={cfg.remat}; see glm5_jax/parallel/plan.py for the formula)")
        if est[mode]["host_bytes"]:
            out["host_bytes"] = est[mode]["host_bytes"]     # the offloaded layer inputs, not in the total
    total = p_bytes + o_bytes + a_bytes
    out["per_device_bytes"] = {"params": p_bytes, "optimizer": o_bytes, "activations": a_bytes, "total": total}
    out["sources"] = sources
    out["fits"] = _fits(total)
    remat_total = p_bytes + o_bytes + est["layer"]["bytes"]
    out["with_layer_remat"] = {"activations_estimate": est["layer"]["bytes"], "total": remat_total,
                               "fits": _fits(remat_total)}
    out["activation_estimates"] = est
    return out


def format_plan(p: dict) -> str:
    def gb(b):
        return f"{b / 1e9:,.2f} GB" if b >= 1e8 else f"{b / 1e6:,.3f} MB"
    pd = p["per_device_bytes"]
    mesh = ",".join(f"{a}:{n}" for a, n in p["mesh"].items())
    lines = [f"preset {p['preset']}  mesh {mesh} ({p['devices']} devices)  batch {p['batch_size']} x seq "
             f"{p['seq_len']}  optimizer {p['optimizer']}  params {p['num_params']:,}",
             "per-device memory:"]
    for k in ("params", "optimizer", "activations", "total"):
        src = p["sources"].get(k, "sum")
        lines.append(f"  {k:<12}{gb(pd[k]):>14}   {src.split(':')[0]}")
    if p.get("host_bytes"):
        lines.append(f"  {'host':<12}{gb(p['host_bytes']):>14}   estimated: scanned layers' inputs (remat=offload)")
    for name, ok in p["fits"].items():
        lines.append(f"{'fits' if ok else 'does not fit'}: {name}  (total {gb(pd['total'])})")
    r = p["with_layer_remat"]
    lines.append(f"with per-layer remat (estimate): activations {gb(r['activations_estimate'])}, total {gb(r['total'])}")
    for name, ok in r["fits"].items():
        lines.append(f"  {'fits' if ok else 'does not fit'}: {name}")
    return "\n".join(lines)
