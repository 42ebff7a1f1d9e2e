"""sft: chat SFT of a tiny model on synthetic multi-turn tool use, through the one train step.

Data: glm5_jax.post.tooldata conversations (calculator arithmetic, key-value lookups, both chained;
follow-up user turns; ~15% with an erroneous first tool call kept in context and masked from the
loss), rendered with GLM's chat template (glm5_jax.data.chat, thinking mode ``mode``) by a byte-level
BPE tokenizer.json trained here on synthetic conversations (train_hf_tokenizer; nothing downloaded).
Training samples are chat.sft_samples (loss only on assistant tokens; interleaved/turn modes: one
sample per user turn, earlier turns' reasoning dropped and not trained), packed by
glm5_jax.rl.sft.pack_examples, trained by glm5_jax.train.train (make_train_step with the batch's
loss_mask).
Held-out: ``eval_conversations`` conversations from a seed stream training never draws from (and
whose split keys training excludes), played against the model before (the initialisation SFT starts
from) and after SFT: glm5_jax.post.agent generates greedily with glm5_jax.infer.generate, executes
the tool calls and feeds the results back.
Primary metric (fixed before the run): final_task_success = fraction of held-out conversations whose
every user turn got the expected answer. Also: tool_call_valid (made >= 1 tool call, every message
parsed, every call a known tool with exactly its arguments), held-out SFT loss, statuses.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np

from experiments.registry import register
from experiments.report import eval_series, md_table, plot_curves, write_report
from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.data.chat import MODES, ChatTemplate, sft_samples
from glm5_jax.fields import check_fields, setting
from glm5_jax.post.agent import run_conversations, summarize
from glm5_jax.post.tooldata import TOOL_ARGS, execute_tool, heldout, make_conversation, tokenizer_texts
from glm5_jax.rl.sft import SFTIterator, pack_eval_batches
from glm5_jax.train import TrainConfig, train
from glm5_jax.train.loop import evaluate
from glm5_jax.train.state import init_train_state


@dataclasses.dataclass(frozen=True)
class ChatSFTConfig:
    """model.vocab_size is tokenizer_vocab rounded up to a multiple of 8 (the trained tokenizer may
    learn fewer pieces; never more)."""
    model: ModelConfig
    train: TrainConfig
    mode: str = "interleaved"              # chat.MODES
    tokenizer_vocab: int = 384
    tokenizer_conversations: int = setting(2000, integer=True, min=1)  # synthetic conversations the tokenizer is trained on
    eval_conversations: int = setting(64, integer=True, min=1)  # held-out, never trained on
    eval_loss_conversations: int = setting(64, integer=True, min=1)  # held-out SFT loss (a disjoint held-out stream)
    p_followup: float = 0.3
    p_error: float = 0.15
    max_new_tokens: int = setting(40, integer=True, min=1)  # per assistant message
    max_steps: int = setting(8, integer=True, min=1)  # assistant messages per conversation
    max_len: int = setting(384, integer=True, min=1)  # cache size of the held-out runs
    primary: str = "task_success"

    DERIVED = {"model.vocab_size": "tokenizer_vocab"}

    def __post_init__(self):
        object.__setattr__(self, "model", self.model.replace(vocab_size=-(-self.tokenizer_vocab // 8) * 8))
        if self.mode not in MODES:
            raise ConfigError(f"ChatSFTConfig.mode={self.mode!r} is invalid: allowed: {', '.join(MODES)}")
        if self.primary not in ("task_success", "tool_call_valid"):
            raise ConfigError(f"ChatSFTConfig.primary={self.primary!r} is invalid: allowed: task_success, tool_call_valid")
        check_fields(self)
        if self.tokenizer_vocab < 300:
            raise ConfigError(f"ChatSFTConfig.tokenizer_vocab={self.tokenizer_vocab!r} is invalid: must be >= 300 "
                              f"(22 GLM specials + 256 bytes + merges)")
        for f in ("p_followup", "p_error"):
            if not 0 <= getattr(self, f) <= 1:
                raise ConfigError(f"ChatSFTConfig.{f}={getattr(self, f)!r} is invalid: a probability in [0, 1]")


def _model(d: int, h: int, layers: int, ffn: int) -> ModelConfig:
    return ModelConfig(vocab_size=384, d_model=d, num_layers=layers, ffn_dim=ffn, attention="mla", num_heads=h,
                       q_lora_rank=d // 2, kv_lora_rank=d // 2, qk_nope_head_dim=d // h,
                       qk_rope_head_dim=max(8, d // (2 * h)), v_head_dim=d // h, num_experts=0, mtp_depth=0,
                       attn_chunk=128)


TINY = ChatSFTConfig(
    model=_model(128, 4, 2, 384),
    train=TrainConfig(steps=800, batch_size=8, seq_len=256, learning_rate=2e-3, warmup_steps=30, min_lr_ratio=0.1,
                      weight_decay=0.0, eval_every=200, log_every=50, ckpt_every=800, seed=0),
)
SMALL = dataclasses.replace(
    TINY, model=_model(256, 8, 4, 768),
    train=TINY.train.replace(steps=2000, batch_size=32, seq_len=512, learning_rate=1e-3, eval_every=250,
                             log_every=100, ckpt_every=1000),
    eval_conversations=512, eval_loss_conversations=256, tokenizer_vocab=1024, max_len=512)


@register("sft", "chat SFT (GLM template, loss on assistant tokens) of a tiny model on synthetic multi-turn "
          "tool use: held-out task success and well-formed tool calls before and after",
          {"tiny": TINY, "small": SMALL})
def run(cfg: ChatSFTConfig, workdir: str, log, mesh=None) -> dict:
    from glm5_jax.data.tokenizer import train_hf_tokenizer

    t_start = time.time()
    mcfg, tc = cfg.model, cfg.train
    kw = dict(p_followup=cfg.p_followup, p_error=cfg.p_error)
    tok = train_hf_tokenizer(tokenizer_texts(cfg.tokenizer_conversations, tc.seed, **kw), cfg.tokenizer_vocab,
                             os.path.join(workdir, "tokenizer.json"))
    if tok.vocab_size > mcfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} ids > model.vocab_size {mcfg.vocab_size}")
    template = ChatTemplate(tok, cfg.mode)
    evals = heldout(cfg.eval_conversations, tc.seed, **kw)
    loss_convs = heldout(cfg.eval_conversations + cfg.eval_loss_conversations, tc.seed, **kw)[cfg.eval_conversations:]
    exclude = {c.prompt for c in evals + loss_convs}
    encode = lambda c: sft_samples(template, c.messages)

    # held-out SFT loss: the held-out conversations' samples, packed like training batches
    loss_samples = [s for c in loss_convs for s in encode(c)]
    loss_batches = pack_eval_batches(loss_samples, tc.eval_batches, tc.seq_len)
    lens = [len(s) for s in loss_samples]
    log(f"[sft] tokenizer {tok.vocab_size} ids; held-out samples: {len(loss_samples)}, tokens/sample mean "
        f"{np.mean(lens):.0f} max {max(lens)}; trained tokens/sample {np.mean([sum(s.loss_mask) for s in loss_samples]):.0f}")

    def play(params, tag):
        t0 = time.time()
        res = run_conversations(mcfg, params, template, evals, execute=execute_tool, tool_args=TOOL_ARGS,
                                max_new_tokens=cfg.max_new_tokens, max_steps=cfg.max_steps, max_len=cfg.max_len)
        s = summarize(res)
        s["wall_s"] = time.time() - t0
        log(f"[sft] {tag}: task_success {s['task_success']:.3f}, tool_call_valid {s['tool_call_valid']:.3f}, "
            f"statuses {s['statuses']} ({s['wall_s']:.0f} s)")
        return s, res

    init_params = init_train_state(mcfg, tc, mesh)[0]["params"]
    before, _ = play(init_params, "before SFT")
    before_loss = evaluate(mcfg, init_params, loss_batches)
    del init_params

    sampler = lambda rng: make_conversation(rng, **kw)
    it = SFTIterator(sampler, None, tc.batch_size, tc.seq_len, seed=tc.seed, exclude=exclude, encode=encode)
    out = train(mcfg, tc, it, os.path.join(workdir, "train"), eval_fn=lambda p: evaluate(mcfg, p, loss_batches),
                log=log, name="sft", mesh=mesh)
    after, results = play(out["params"], "after SFT")

    h = out["history"]
    report = {
        "initial_task_success": before["task_success"], "final_task_success": after["task_success"],
        "initial_tool_call_valid": before["tool_call_valid"], "final_tool_call_valid": after["tool_call_valid"],
        "primary_metric": f"final_{cfg.primary}", "mode": cfg.mode,
        "before": before, "after": after,
        "initial_eval_loss": before_loss["eval_loss"], "final_eval_loss": out["final"]["eval_loss"],
        "final_train_loss": float(np.mean([r["loss"] for r in h[-10:]])),
        "steps": tc.steps, "tokens_per_step": tc.batch_size * tc.seq_len, "tokenizer_vocab": tok.vocab_size,
        "params": int(sum(x.size for x in jax.tree.leaves(out["params"]))),
        "eval_conversations": len(evals), "eval_loss_samples": len(loss_samples), "wall_time_s": None,
    }
    steps = [r["step"] for r in h]
    plot_curves(os.path.join(workdir, "loss.png"),
                {"train (assistant tokens)": (steps, [r["loss"] for r in h]),
                 "held-out": ([0] + eval_series(h)[0], [before_loss["eval_loss"]] + eval_series(h)[1])},
                title=f"chat SFT loss ({cfg.mode} thinking)", ylabel="cross-entropy", logy=True)
    examples = []
    for r, c in list(zip(results, evals))[:3]:
        examples.append(f"- `{c.user_turns}` expected {c.answers}: {r.status}, answers {r.answers}\n\n```\n"
                        + template.decode(template.render(r.messages).ids)[:1200] + "\n```\nlast generated message: `"
                        + repr(r.last_text)[:300] + "`")
    report["wall_time_s"] = time.time() - t_start
    rows = [[k, before[k], after[k]] for k in ("task_success", "tool_call_valid", "calls_per_conversation")]
    rows.append(["held-out SFT loss", before_loss["eval_loss"], out["final"]["eval_loss"]])
    md = f"""# sft

Chat SFT ({cfg.mode} thinking) of a {report['params']:,}-parameter MLA model (d_model {mcfg.d_model},
{mcfg.num_layers} layers) on synthetic multi-turn tool use (calculator, kv lookup, both chained; follow-up
turns with p={cfg.p_followup}; erroneous first tool calls with p={cfg.p_error}, kept in context, masked from
the loss). Tokenizer: byte-level BPE, {tok.vocab_size} ids, trained here. {tc.steps} steps x {tc.batch_size}x{tc.seq_len}
packed tokens, loss on assistant tokens only. Held-out: {len(evals)} conversations never trained on, played
greedily with tool execution (at most {cfg.max_steps} assistant messages of {cfg.max_new_tokens} tokens).
Primary metric (fixed before the run): **final_{cfg.primary}**.

{md_table(["metric", "before SFT", "after SFT"], rows)}

Statuses before: {before['statuses']}; after: {after['statuses']}. Well-formed share of generated tool calls
after: {after['wellformed_call_rate']}.

![loss](loss.png)

Held-out examples after SFT:

{chr(10).join(examples)}

Wall time {report['wall_time_s']:.0f} s.
"""
    write_report(workdir, report, md)
    return report
