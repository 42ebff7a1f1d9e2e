"""DSA evaluations beside the LM loss: a model evaluated with oracle top-k (each query's k keys = the top-k
of its own head-averaged dense attention), query-position buckets for the attention-mass figures
(glm5_jax.eval.selection), and the wall time of one attention layer dense vs sparse."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from glm5_jax.config import ModelConfig
from glm5_jax.intervals import fmt_interval, mean_interval, paired_bootstrap_interval, wilson_interval


@functools.lru_cache(maxsize=None)
def _indexer_placeholder(dsa_cfg: ModelConfig):
    """A DSA parameter tree of zeros: a dense MLA model's params grafted onto it run as DSA with oracle
    top-k (the indexer's params are never read then: the selection comes from the main attention)."""
    from glm5_jax.model import init_params
    shapes = jax.eval_shape(lambda: init_params(dsa_cfg, jax.random.PRNGKey(0)))
    return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes)


def oracle_config(dsa_cfg: ModelConfig, k: int) -> ModelConfig:
    return dsa_cfg.replace(index_topk=k, dsa_topk_source="oracle")


def as_oracle(dsa_cfg: ModelConfig, k: int, params) -> tuple[ModelConfig, dict]:
    """(config, params) of `params` (a dense MLA model's, or a DSA model's) evaluated with oracle top-k k."""
    from glm5_jax.train.stages import graft
    cfg = oracle_config(dsa_cfg, k)
    flat = traverse_util.flatten_dict(params)
    if not any("indexer" in key for key in flat):       # MLA params: graft onto the DSA tree
        params = graft(_indexer_placeholder(dsa_cfg.replace(index_topk=1)), params)
    return cfg, params


def mass_buckets(T: int) -> tuple[tuple[int, int], ...]:
    """Query-position buckets of the attention-mass figures: [0, T/8), [T/8, T/4), [T/4, T/2), [T/2, T)."""
    cuts = sorted({0, T // 8, T // 4, T // 2, T})
    return tuple((a, b) for a, b in zip(cuts, cuts[1:]) if b > a)


def time_attention(cfg_dense: ModelConfig, cfg_sparse: ModelConfig, seq_len: int, batch: int, reps: int = 2) -> dict:
    """Forward+backward wall time of one attention layer (with the indexer for DSA), dense vs sparse."""
    from glm5_jax.attention.mla import MLAttention
    from glm5_jax.layers.rope import rope_angles
    out = {}
    x = jax.random.normal(jax.random.PRNGKey(0), (batch, seq_len, cfg_dense.d_model), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(seq_len), (batch, seq_len))
    cos, sin = rope_angles(pos, cfg_dense.qk_rope_head_dim, cfg_dense.rope_theta)
    for name, cfg, itype in (("dense_mla", cfg_dense, None), ("sparse_dsa", cfg_sparse, "full")):
        mod = MLAttention(cfg.replace(attn_chunk=256), itype)
        params = mod.init(jax.random.PRNGKey(1), x[:, :8], cos[:, :8], sin[:, :8])["params"]
        loss = jax.jit(jax.grad(lambda p, x: jnp.sum(mod.apply({"params": p}, x, cos, sin)[0] ** 2), argnums=(0, 1)))
        jax.block_until_ready(loss(params, x))
        t = time.perf_counter()
        for _ in range(reps):
            jax.block_until_ready(loss(params, x))
        out[name] = (time.perf_counter() - t) / reps
    out["dense_over_sparse"] = out["dense_mla"] / out["sparse_dsa"]
    return out


def mass_row(prefix: str, res: dict, keys=("selected_mass", "oracle_mass", "recall")) -> dict:
    """Flat metrics-row entries of an attention-mass result: over all positions and per bucket (mean over layers)."""
    from glm5_jax.eval.selection import mass_beyond
    out = {}
    allpos = mass_beyond(res, 0)
    for key in keys:
        name = {"selected_mass": "indexer_mass", "oracle_mass": "oracle_mass", "recall": "indexer_recall_of_oracle"}[key]
        out[f"{prefix}{name}"] = allpos[key]
        for j, v in enumerate(res["mean"][key]):
            if v is not None:
                out[f"{prefix}{name}_b{j}"] = v
    return out


def decomposition_fn(dsa_cfg: ModelConfig, test_lm, mass_lm, ks, arm: str, mass_ks=None):
    """fn(params) -> the evaluations that split a DSA model's loss gap (recorded in a training run's eval rows).
    arm "mla" (params of a dense model): for each top-k k, the test LM loss with oracle top-k
    ("oracle_test_loss_k<k>": the cost of attending to k keys at all) and its oracle mass ("mla_oracle_mass_k<k>")
    for k in mass_ks (default: every k). arm "dsa" (a DSA model at top-k ks[0]): the attention mass on its
    indexer's keys and on the oracle's ("indexer_mass", "oracle_mass", "indexer_recall_of_oracle", per bucket
    "_b<j>") and its test LM loss with oracle top-k instead of its indexer ("oracle_test_loss")."""
    from glm5_jax.eval.selection import mass_beyond
    from glm5_jax.eval.evaluator import evaluate
    from glm5_jax.eval.metrics import attention_mass
    buckets = mass_buckets(test_lm[0]["tokens"].shape[1])

    def fn(params):
        out = {}
        if arm == "mla":
            for k in ks:
                c, p = as_oracle(dsa_cfg, k, params)
                out[f"oracle_test_loss_k{k}"] = evaluate(c, p, test_lm)["eval_loss"]
                if mass_ks is None or k in mass_ks:
                    out[f"mla_oracle_mass_k{k}"] = mass_beyond(attention_mass(c, p, mass_lm, buckets), 0)["oracle_mass"]
        else:
            (k,) = ks
            out.update(mass_row("", attention_mass(dsa_cfg.replace(index_topk=k), params, mass_lm, buckets)))
            oc, op = as_oracle(dsa_cfg, k, params)
            out["oracle_test_loss"] = evaluate(oc, op, test_lm)["eval_loss"]
        return out
    return fn



def gap_pct(dsa_loss: float, mla_loss: float) -> float:
    return 100.0 * (dsa_loss - mla_loss) / mla_loss


def decomposition_entry(dsa_hists: list, mla_hists: list, k: int, step: int, buckets, interval=None) -> dict:
    """One gap-decomposition entry from the evaluations (decomposition_fn) each seed's DSA run (top-k k) and
    dense MLA run recorded at `step` (their metrics rows): the whole gap % (DSA with its indexer), the oracle
    gap (MLA with oracle top-k: sparsity itself), their paired difference (the indexer's choice), the DSA
    model's gap with oracle top-k instead of its indexer, and the attention mass figures. interval(values) ->
    {"mean", "lo", "hi", "n"} over seeds (default glm5_jax.intervals.mean_interval)."""
    from glm5_jax.eval.stats import metric_at
    interval = interval or mean_interval
    mla = [metric_at(h, step, "test_loss") for h in mla_hists]
    og = [gap_pct(metric_at(h, step, f"oracle_test_loss_k{k}"), m) for h, m in zip(mla_hists, mla)]
    ig = [gap_pct(metric_at(h, step, "test_loss"), m) for h, m in zip(dsa_hists, mla)]
    dg = [gap_pct(metric_at(h, step, "oracle_test_loss"), m) for h, m in zip(dsa_hists, mla)]
    per = lambda key: [metric_at(h, step, key) for h in dsa_hists]
    im, om, rc = per("indexer_mass"), per("oracle_mass"), per("indexer_recall_of_oracle")
    rows = [next((r for r in h if r.get("step") == step and "test_loss" in r), {}) for h in mla_hists]
    mom = [r.get(f"mla_oracle_mass_k{k}") for r in rows]
    mom = None if any(v is None for v in mom) else float(np.mean(mom))
    sel = [i - o for i, o in zip(ig, og)]
    bucket = lambda key: [float(np.mean([metric_at(h, step, f"{key}_b{j}") for h in dsa_hists]))
                          for j in range(len(buckets))]
    o_iv, s_iv = interval(og), interval(sel)
    return {"topk": k, "adaptation_steps": step,
            "oracle_gap_pct": o_iv, "oracle_gap_pct_per_seed": og,
            "indexer_gap_pct": interval(ig), "indexer_gap_pct_per_seed": ig,
            "selection_cost_pct": s_iv, "dsa_oracle_gap_pct": interval(dg),
            "selection_cost_same_params_pct": interval([i - d for i, d in zip(ig, dg)]),
            "oracle_mass": float(np.mean(om)), "oracle_mass_interval": interval(om),
            "indexer_mass": float(np.mean(im)), "indexer_mass_interval": interval(im),
            "indexer_recall_of_oracle": float(np.mean(rc)), "mla_oracle_mass": mom,
            "mass_by_bucket": {"buckets": [list(b) for b in buckets], "indexer": bucket("indexer_mass"),
                               "oracle": bucket("oracle_mass")},
            "dominant": "sparsity" if o_iv["mean"] >= s_iv["mean"] else "indexer"}



def lossless_verdict(gap: dict, margin: float) -> tuple[str, str]:
    """(verdict, one sentence) for the primary gap's interval against the +-margin fixed before the run."""
    m, lo, hi = gap["mean"], gap["lo"], gap["hi"]
    if lo is None:
        return "undetermined", (f"With one seed there is no interval, so this run cannot say whether DSA is lossless "
                                f"(gap {m:+.2f}%).")
    iv = f"{m:+.2f}% [{lo:+.2f}, {hi:+.2f}] over {gap['n']} seeds"
    if -margin <= lo and hi <= margin:
        return "lossless", (f"DSA is lossless here within the +-{margin:g}% margin fixed before the run: its test "
                            f"LM loss is {iv} from continued MLA's.")
    if lo > 0:
        return "worse", (f"DSA is not lossless here: its test LM loss is above continued MLA's by {iv} "
                         f"(the interval excludes 0{' and exceeds the margin' if lo > margin else ''}).")
    if hi < 0:
        return "better", f"DSA's test LM loss is below continued MLA's by {iv} (the interval excludes 0)."
    return "inconclusive", (f"Inconclusive: the gap {iv} includes 0 but reaches beyond the +-{margin:g}% margin, so "
                            "this run neither shows DSA lossless nor shows a loss.")



def attention_flops(mla_cfg: ModelConfig, dsa_cfg: ModelConfig, seq_len: int) -> dict:
    """Forward attention FLOPs per token of dense MLA vs DSA (+ its indexer) at seq_len (glm5_jax.flops)."""
    from glm5_jax.flops import estimate
    em, ed = estimate(mla_cfg, seq_len), estimate(dsa_cfg, seq_len)
    return {"dense_mla_attention_fwd_per_token": em["attention_flops_per_token_fwd"],
            "dsa_attention_fwd_per_token": ed["attention_flops_per_token_fwd"],
            "dsa_indexer_fwd_per_token": ed["indexer_flops_per_token_fwd"],
            "dense_over_dsa": em["attention_flops_per_token_fwd"] /
            (ed["attention_flops_per_token_fwd"] + ed["indexer_flops_per_token_fwd"]),
            "train_flops_per_token_mla": em["train_flops_per_token"], "train_flops_per_token_dsa": ed["train_flops_per_token"]}


# ---- the dsa_vs_mla experiment's evaluations and figures (experiments/dsa_vs_mla.py) ----------------------

def phase_eval_fn(cfg: ModelConfig, lm_batches, ret_batches, test_lm=None, extra=None):
    """Eval during training (glm5_jax.eval): LM loss on the dev LM batches and dev retrieval accuracy (if probes
    are given); with test_lm, the test LM loss too ("test_loss", "test_accuracy"), recorded for the report and
    never used to choose anything; extra(params) -> more entries (decomposition_fn)."""
    from glm5_jax.eval import LMLoss, RetrievalAccuracy, evaluate

    def eval_fn(params):
        out = evaluate(cfg, params, lm_batches)
        if ret_batches:
            out["retrieval_accuracy"] = evaluate(cfg, params, ret_batches, [RetrievalAccuracy()])["retrieval_accuracy"]
        if test_lm:
            out.update(evaluate(cfg, params, test_lm, [LMLoss("test_loss", "test_accuracy")]))
        if extra is not None:
            out.update(extra(params))
        return out
    return eval_fn


def recorded_test_loss(history: list[dict], step: int) -> float:
    """The test LM loss a continued phase recorded at `step` (its eval rows, phase_eval_fn with test_lm)."""
    from glm5_jax.eval.stats import metric_at
    return metric_at(history, step, "test_loss")


def gap_at(dsa_hists: list, mla_hists: list, step: int) -> tuple[dict, list]:
    """(mean_interval over seeds, per-seed list) of the test LM-loss gap % DSA vs MLA that each seed's two
    runs recorded at `step`."""
    g = [gap_pct(recorded_test_loss(d, step), recorded_test_loss(m, step)) for d, m in zip(dsa_hists, mla_hists)]
    return mean_interval(g), g


def decomposition_sentence(e: dict, T: int) -> str:
    """Which source dominates at one decomposition entry, with its intervals."""
    iv = lambda d: fmt_interval(d["mean"], d["lo"], d["hi"], 2)
    what = ("the cost of attending to k keys at all (oracle top-k on the continued MLA model)" if e["dominant"] == "sparsity"
            else "the indexer's choice of keys")
    return (f"At top-k {e['topk']} = T/{T // e['topk']} after {e['adaptation_steps']} sparse-adaptation steps the DSA "
            f"gap {iv(e['indexer_gap_pct'])}% splits into sparsity itself {iv(e['oracle_gap_pct'])}% and the indexer's "
            f"choice {iv(e['selection_cost_pct'])}% (on the adapted DSA params themselves, indexer vs oracle top-k: "
            f"{iv(e['selection_cost_same_params_pct'])}%): {what} dominates (attention mass on the selected keys: indexer "
            f"{e['indexer_mass']:.3f}, oracle {e['oracle_mass']:.3f}; indexer recall of the oracle's keys "
            f"{e['indexer_recall_of_oracle']:.3f}).")


def decomposition_verdict(entries: list, primary_k: int, T: int, lr_entries: list, base_lr: float) -> str:
    """The report's decomposition paragraph: the primary top-k's sentence, how many top-k fractions each source
    dominates, and the fixed-before-the-run learning-rate arm's figures (lr_entries, if any)."""
    n_sparsity = sum(e["dominant"] == "sparsity" for e in entries)
    out = (decomposition_sentence(next(e for e in entries if e["topk"] == primary_k), T)
           + f" Over the {len(entries)} top-k fractions, sparsity itself dominates at {n_sparsity} and the indexer's "
           f"choice at {len(entries) - n_sparsity}.")
    if lr_entries:
        e, f2 = lr_entries[0], lambda k: fmt_interval(lr_entries[0][k], digits=2)
        out += (f" At adaptation rate {e['learning_rate']:g} (fixed before the run; the default is the base's "
                f"final {base_lr:g}) the DSA gap is {f2('indexer_gap_pct')}% and the indexer's choice "
                f"{f2('selection_cost_pct')}% (on those params, indexer vs oracle top-k: "
                f"{f2('selection_cost_same_params_pct')}%; with oracle top-k they are {f2('dsa_oracle_gap_pct')}% "
                "above continued MLA: the rate moved the model, not only its selection).")
    return out


def gap_figures(seeds: dict, topk: dict, K: int, T: int, S: int, P: int, C: int, buckets, lr: float,
                lr_choice: float | None) -> dict:
    """The gap's dependence and sources from each seed's runs (dsa_vs_mla's run_seed results): the test LM-loss
    gap against top-k / T after S sparse steps (topk: {fraction: k}) and against adaptation length at K (every S
    steps up to C; P base steps), the gap decomposition at each k, against adaptation length, and at the
    learning-rate arm's rate lr_choice (None: no such arm), and the decomposition paragraph."""
    rs = list(seeds.values())
    mla_h, dsa_h = [r["runs"]["mla"]["history"] for r in rs], [r["runs"]["dsa"]["history"] for r in rs]
    vs_topk = [{"topk_fraction": fr, "topk": k, "gap_pct": iv["mean"], "interval": iv, "adaptation_steps": S,
                "per_seed": g} for fr, k in topk.items() for iv, g in [gap_at([r["sweep"][k] for r in rs], mla_h, S)]]
    lengths = sorted(set(range(S, C + 1, S)) | {C})
    vs_len = [{"adaptation_steps": L, "ratio_to_base": L / P, "topk_fraction": K / T, "gap_pct": iv["mean"],
               "interval": iv, "per_seed": g} for L in lengths for iv, g in [gap_at(dsa_h, mla_h, L)]]
    dec = [{"topk_fraction": fr, "learning_rate": lr, **decomposition_entry([r["sweep"][k] for r in rs], mla_h, k, S,
                                                                             buckets)} for fr, k in topk.items()]
    dec_len = [{"topk_fraction": K / T, "learning_rate": lr, **decomposition_entry(dsa_h, mla_h, K, L, buckets)}
               for L in lengths]
    dec_lr = [] if lr_choice is None else [{"topk_fraction": K / T, "learning_rate": lr_choice, **decomposition_entry(
        [r["lr_choice"] for r in rs], mla_h, K, S, buckets)}]
    return {"gap_vs_topk": vs_topk, "gap_vs_adaptation": vs_len, "gap_decomposition": dec,
            "gap_decomposition_vs_adaptation": dec_len, "gap_decomposition_lr_choice": dec_lr,
            "gap_decomposition_verdict": decomposition_verdict(dec, K, T, dec_lr, lr)}


def mean_attention_mass(masses: list, buckets) -> dict:
    """Per-seed attention_mass results of one model -> the first seed's per-layer figures and the mean over
    seeds per bucket of selected / oracle mass and recall (None where a seed has none)."""
    return {"layers_first_seed": dict(masses[0]["layers"]),
            "mean": {key: [float(np.mean([m["mean"][key][j] for m in masses]))
                           if all(m["mean"][key][j] is not None for m in masses) else None for j in range(len(buckets))]
                     for key in ("selected_mass", "oracle_mass", "recall")},
            "buckets": [list(b) for b in buckets]}


def decomposition_table(entries: list) -> tuple[list, list]:
    """(header, rows) of the report's decomposition table, one row per gap_figures entry."""
    ivs = lambda iv: fmt_interval(iv, digits=2)
    header = ["top-k / T", "steps", "lr", "indexer gap %", "oracle gap %", "indexer's choice %", "DSA + oracle gap %",
              "DSA: indexer - oracle %", "indexer mass", "oracle mass", "MLA oracle mass", "recall of oracle keys"]
    rows = [[f"1/{round(1 / e['topk_fraction'])}", e["adaptation_steps"], f"{e['learning_rate']:g}"]
            + [ivs(e[k]) for k in ("indexer_gap_pct", "oracle_gap_pct", "selection_cost_pct", "dsa_oracle_gap_pct",
                                   "selection_cost_same_params_pct")]
            + [e["indexer_mass"], e["oracle_mass"], "-" if e["mla_oracle_mass"] is None else e["mla_oracle_mass"],
               e["indexer_recall_of_oracle"]] for e in entries]
    return header, rows


def attention_mass_table(masses: dict, buckets) -> tuple[list, list]:
    """(header, rows) of the attention-mass table: per model (mean_attention_mass results) and figure, one
    column per position bucket."""
    return (["model", "figure"] + [f"[{a},{b})" for a, b in buckets],
            [[name, key] + [("n/a" if v is None else f"{v:.3f}") for v in m["mean"][key]]
             for name, m in masses.items() for key in ("selected_mass", "oracle_mass", "recall")])


def distance_series(seeds: dict, names: list, bins) -> dict:
    """The test probes' accuracy per arm and DSA's answer-key recall per layer against the record's distance
    (pooled over seeds, in `bins`): {label: (bin centres, means)}."""
    from glm5_jax.eval.stats import distance_curve
    rs = list(seeds.values())
    out = {f"{n} accuracy": distance_curve([r["test"][n] for r in rs], lambda s: s["correct"], bins) for n in names}
    for layer in rs[0]["test"]["dsa"]["answer_key_recall"]:
        out[f"dsa recall {layer}"] = distance_curve([r["test"]["dsa"] for r in rs],
                                                    lambda s, k=layer: s["answer_key_recall"][k], bins)
    return out


def continued_vs_base(seeds: dict) -> dict:
    """Dev LM loss at the end of the base and of the continued phases, per seed and averaged; at_or_below: the
    continued MLA arm ended at or below its base's in every seed (not jolted off its schedule)."""
    per = {str(s): {"base": float(r["base"]["final"]["eval_loss"]),
                    "continued_mla": float(r["runs"]["mla"]["final"]["eval_loss"]),
                    "dsa_after_warmup": float(r["warm"]["final"]["eval_loss"]),
                    "dsa": float(r["runs"]["dsa"]["final"]["eval_loss"])} for s, r in seeds.items()}
    base = float(np.mean([v["base"] for v in per.values()]))
    cont = float(np.mean([v["continued_mla"] for v in per.values()]))
    return {"base_dev_loss": base, "continued_mla_dev_loss": cont, "diff": cont - base,
            "at_or_below": all(v["continued_mla"] <= v["base"] for v in per.values()), "per_seed": per}


def arm_figures(seeds: dict, names: list, n_probes: int) -> tuple[dict, dict]:
    """(arms, per_seed): per arm the test retrieval accuracy and LM loss with intervals over seeds, token
    accuracy, dev retrieval accuracy (DSA: answer-key recall after warm-up and after adaptation); per seed the
    retrieval accuracy with its Wilson interval over n_probes probes and the LM loss."""
    arms, per_seed = {}, {}
    rs = list(seeds.values())
    for name in names:
        accs = [float(r["test"][name]["correct"].mean()) for r in rs]
        losses = [float(r["test_lm"][name]["eval_loss"]) for r in rs]
        a = {"retrieval_accuracy": float(np.mean(accs)), "retrieval_accuracy_interval": mean_interval(accs),
             "final_eval_loss": float(np.mean(losses)), "final_eval_loss_interval": mean_interval(losses),
             "final_eval_accuracy": float(np.mean([r["test_lm"][name]["eval_accuracy"] for r in rs])),
             "dev_retrieval_accuracy": float(np.mean([r["runs"][name]["final"]["retrieval_accuracy"] for r in rs]))}
        if name == "dsa":
            layers = rs[0]["test"]["dsa"]["answer_key_recall"]
            a["answer_key_recall"] = {k: float(np.mean([r["test"]["dsa"]["answer_key_recall"][k].mean() for r in rs]))
                                      for k in layers}
            a["answer_key_recall_after_warmup"] = {k: float(np.mean([r["answer_key_recall_after_warmup"][k] for r in rs]))
                                                   for k in layers}
        arms[name] = a
        per_seed[name] = {str(s): {"retrieval_accuracy": float(r["test"][name]["correct"].mean()),
                                   "retrieval_wilson_95": wilson_interval(int(r["test"][name]["correct"].sum()), n_probes),
                                   "final_eval_loss": float(r["test_lm"][name]["eval_loss"])}
                          for s, r in seeds.items()}
    return arms, per_seed


def retrieval_figures(seeds: dict, arms: dict, pairs: int, value_digits: int) -> dict:
    """The secondary retrieval figures: DSA - MLA test accuracy paired over (seed, probe) with a bootstrap
    interval, chance (a random value) and copy (a random one of the `pairs` planted values) levels, and the
    probes' record distances ("distances": numpy, every seed's)."""
    rs = list(seeds.values())
    pa = np.concatenate([r["test"]["dsa"]["correct"] for r in rs])
    pb = np.concatenate([r["test"]["mla"]["correct"] for r in rs])
    diff, dlo, dhi = paired_bootstrap_interval(pa, pb)
    chance = 10.0 ** -value_digits
    # copying the value of a random one of the planted records is right when it is the queried one, or by chance
    copy = 1.0 / pairs + (1.0 - 1.0 / pairs) * chance
    return {"mla": arms["mla"]["retrieval_accuracy"], "dsa": arms["dsa"]["retrieval_accuracy"],
            "dsa_minus_mla": {"diff": diff, "lo": dlo, "hi": dhi}, "chance_accuracy": chance, "copy_accuracy": copy,
            "distances": np.concatenate([r["test"]["mla"]["distance"] for r in rs])}


__all__ = ["arm_figures", "as_oracle", "attention_flops", "attention_mass_table", "continued_vs_base",
           "decomposition_entry", "decomposition_fn", "decomposition_sentence", "decomposition_table",
           "decomposition_verdict", "distance_series", "gap_at", "gap_figures", "gap_pct", "lossless_verdict", "mass_buckets",
           "mass_row", "mean_attention_mass", "oracle_config", "phase_eval_fn", "recorded_test_loss",
           "retrieval_figures", "time_attention"]
