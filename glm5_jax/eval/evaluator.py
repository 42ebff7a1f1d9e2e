"""One mesh-aware evaluator: batches placed as the loop places them, one jitted forward per (model, forward
variant, metrics), per-token NLL from glm5_jax.losses.token_logsumexp_and_target, pluggable metrics.

    from glm5_jax.eval import evaluate, LMLoss, PositionLoss, TokenOutputs
    out = evaluate(model_cfg, params, batches, [LMLoss(), PositionLoss(buckets=((0, 128), (128, 512)))])

A metric is a frozen dataclass with
  forward          the forward variant it reads: "plain" (logits), "mtp" (+ MTP logits), "indexer_dense" (the DSA
                   indexer's dense KL / recall sown), "attention" (each attention module's outputs captured:
                   the DSA top-k indices), "intermediates" (everything the model sows, e.g. the DSA selection
                   stats of a config with dsa_selection_stats);
  device(out, b)   traced inside the jitted program: `out` holds "logits" (float32 [B, T, V]), "pred" (argmax),
                   and when the batch has targets "nll" ([B, T] logsumexp - target logit, unmasked) and "mask"
                   (float32 loss mask), plus "mtp_logits" / "intermediates" per variant; returns a pytree;
  reduce(vals, bs) on the host: the per-batch values (numpy, in batch order) and the host batches -> a dict.
Metrics of one variant share one program; each batch is placed once. With params on a mesh (every program of
glm5_jax.train puts them on one), every batch is split over the mesh's batch axes (replicated when its rows
do not split evenly), so evaluation runs sharded whenever training does, on one process or many; scalar sums
are reduced on device, per-row outputs are gathered to every process.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.config import ModelConfig
from glm5_jax.eval.placement import params_mesh, place_batch
from glm5_jax.losses import token_logsumexp_and_target

VARIANTS = ("plain", "mtp", "indexer_dense", "attention", "intermediates")
_FROM_PARAMS = object()


class Metric:
    """Base of the evaluator's metrics (see the module docstring); subclasses are frozen dataclasses."""
    forward = "plain"

    def device(self, out: dict, batch: dict) -> Any:
        raise NotImplementedError

    def reduce(self, values: list, batches: list[dict]) -> dict:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class LMLoss(Metric):
    """Token-mean loss and top-1 accuracy over loss_mask -> {loss_key, accuracy_key}; also the sums
    ("<loss_key>_sum", "<loss_key>_tokens") when sums=True. Batch sums on device, added in batch order on the host
    in float64 (train.loop.evaluate's figures)."""
    loss_key: str = "eval_loss"
    accuracy_key: str = "eval_accuracy"
    sums: bool = False

    def device(self, out, batch):
        hit = jnp.sum((out["pred"] == batch["targets"]).astype(jnp.float32) * out["mask"])
        return jnp.sum(out["nll"] * out["mask"]), jnp.sum(out["mask"]), hit

    def reduce(self, values, batches):
        tot, n, correct = 0.0, 0.0, 0.0
        for s, c, hit in values:
            tot, n, correct = tot + float(s), n + float(c), correct + float(hit)
        out = {self.loss_key: tot / max(n, 1.0), self.accuracy_key: correct / max(n, 1.0)}
        if self.sums:          # per batch, float32 as on device (a caller's own float32 ratio)
            out[f"{self.loss_key}_sums"] = [np.float32(v[0]) for v in values]
            out[f"{self.loss_key}_tokens"] = [np.float32(v[1]) for v in values]
        return out


def _is_attention(mdl, method_name: str) -> bool:
    from glm5_jax.attention.mla import MLAttention
    return method_name == "__call__" and isinstance(mdl, MLAttention)


def _forward(cfg: ModelConfig, variant: str):
    from glm5_jax.model import GLM5
    model = GLM5(cfg)
    if variant not in VARIANTS:
        raise ValueError(f"forward variant {variant!r} is invalid: one of {', '.join(VARIANTS)}")

    def f(params, b):
        kw = {"mtp": True} if variant == "mtp" else {}
        if variant == "indexer_dense":
            kw.update(indexer_loss="dense", mutable=["intermediates"])
        elif variant == "intermediates":
            kw.update(mutable=["intermediates"])
        elif variant == "attention":
            kw.update(capture_intermediates=_is_attention, mutable=["intermediates"])
        res = model.apply({"params": params}, b["tokens"], b["positions"], b["segment_ids"], **kw)
        res, state = res if "mutable" in kw else (res, {})
        inter = state.get("intermediates", {})
        logits = res["logits"].astype(jnp.float32)
        out = {"logits": logits, "pred": jnp.argmax(logits, axis=-1), "intermediates": inter}   # unused: not computed
        if "mtp_logits" in res:
            out["mtp_logits"] = res["mtp_logits"]
        if "targets" in b:
            lse, tgt = token_logsumexp_and_target(logits, b["targets"])
            out["nll"] = lse - tgt
            out["mask"] = b["loss_mask"].astype(jnp.float32)
        return out
    return f


@functools.lru_cache(maxsize=None)
def _program(cfg: ModelConfig, variant: str, metrics: tuple):
    """One jitted (params, batch) -> tuple of each metric's device values; one per (model, variant, metrics)
    for the whole process (seeds and phases reuse the trace)."""
    fwd = _forward(cfg, variant)
    return jax.jit(lambda p, b: tuple(m.device(fwd(p, b), b) for m in metrics))


def _to_host(x):
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def evaluate(model_cfg: ModelConfig, params, batches: Iterable[dict], metrics: Sequence[Metric] = (LMLoss(),), *,
             mesh=_FROM_PARAMS) -> dict:
    """Every metric over `batches` (full host batches, the same on every process) -> the merged dict of their
    reduce()s. mesh: where the batches go (default: the mesh the params live on; None: the default device)."""
    mesh = params_mesh(params) if mesh is _FROM_PARAMS else mesh
    metrics = tuple(metrics)
    groups: dict[str, list] = {}
    for m in metrics:
        groups.setdefault(m.forward, []).append(m)
    programs = {v: _program(model_cfg, v, tuple(ms)) for v, ms in groups.items()}
    values: dict[int, list] = {id(m): [] for m in metrics}
    host = []
    for batch in batches:
        b = place_batch(mesh, batch)
        for v, ms in groups.items():
            for m, o in zip(ms, programs[v](params, b)):
                values[id(m)].append(o)
        host.append(batch)
    out: dict = {}
    for m in metrics:
        out.update(m.reduce([jax.tree.map(_to_host, v) for v in values[id(m)]], host))
    return out


def split_stacks(tree: dict) -> dict:
    """{layer path: array} with a scanned stack's leading layer axis ([repeats, B, ...], ndim 4) split into
    path[r] entries (one per layer of the stack)."""
    out = {}
    for path, v in tree.items():
        v = np.asarray(v)
        if v.ndim == 4:
            for r in range(v.shape[0]):
                out[f"{path}[{r}]"] = v[r]
        else:
            out[path] = v
    return out


__all__ = ["LMLoss", "Metric", "VARIANTS", "evaluate", "split_stacks"]
