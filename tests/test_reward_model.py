"""Reward model (issue 32 item 1): the one GLM5 with its scalar head, the Bradley-Terry loss, the pair file
checks and the tools.train_reward_model CLI."""

import json
import os
import random
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.config import ModelConfig
from glm5_jax.model import GLM5, init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GOOD = ["calm", "bright", "kind", "clear", "warm", "gentle"]
BAD = ["dull", "harsh", "cold", "vague", "rude", "grim"]
# the cheapest trunk to compile: one plain-attention dense layer
SMALL = ["model.attention=mha", "model.num_heads=2", "model.num_kv_heads=2", "model.d_model=32", "model.num_layers=1",
         "model.num_experts=0", "model.ffn_dim=64", "train.seq_len=48", "rm.tokenizer_vocab=300"]


def _pairs(n, seed, exclude=()):
    """A learnable preference: the chosen reply is made of GOOD words, the rejected one of BAD words."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        c = " ".join(rng.choice(GOOD) for _ in range(rng.randint(2, 5)))
        r = " ".join(rng.choice(BAD) for _ in range(rng.randint(2, 5)))
        if (c, r) not in exclude:
            out.append({"prompt": f"Describe item {rng.randint(0, 999)}.", "chosen": c, "rejected": r})
    return out


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _cli(argv, capsys):
    """`python -m tools.train_reward_model ARGV` in a subprocess (its own absl flag registry: other CLIs run in
    this test process define flags of the same names) -> (exit status, stdout, stderr)."""
    del capsys
    r = subprocess.run([sys.executable, "-m", "tools.train_reward_model", *argv], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    return r.returncode, r.stdout, r.stderr


def test_cli_learns_heldout_preferences_and_resumes(tmp_path, capsys):
    """Trained on 300 pairs, the reward model ranks 100 held-out pairs (none of their (chosen, rejected)
    replies seen in training) far above chance; running the same command again resumes from the last
    checkpoint (no step re-run) and reports the same held-out accuracy."""
    train = _pairs(300, 0)
    seen = {(p["chosen"], p["rejected"]) for p in train}
    held = _pairs(100, 1, seen)
    assert not seen & {(p["chosen"], p["rejected"]) for p in held}
    argv = ["--data", _write(tmp_path / "train.jsonl", train), "--eval", _write(tmp_path / "eval.jsonl", held),
            "--workdir", str(tmp_path / "rm"), "--json"]
    for s in SMALL + ["train.steps=40", "train.eval_every=40", "train.ckpt_every=20"]:
        argv += ["--set", s]
    rc, out, err = _cli(argv, capsys)
    assert rc == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["pairwise_accuracy"] >= 0.9 and res["eval_pairs"] == 100 and res["train_pairs"] == 300
    assert "ETA" in err                                               # progress lines
    rows = [json.loads(l) for l in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    rc, out2, err2 = _cli(argv, capsys)
    assert rc == 0 and "resumed from step 40" in err2
    assert json.loads(out2.strip().splitlines()[-1])["pairwise_accuracy"] == res["pairwise_accuracy"]


@pytest.mark.parametrize("line,field", [
    ('{"prompt": "hi", "chosen": "a"', "not valid JSON"),
    ('{"prompt": "hi", "chosen": "a"}', "field 'rejected' is missing"),
    ('{"prompt": "hi", "chosen": 3, "rejected": "b"}', "field 'chosen' must be a non-empty string"),
    ('{"prompt": "hi", "chosen": "a", "rejected": [{"role": "user", "content": "x"}]}',
     "field 'rejected' must end with an assistant message"),
    ('["prompt", "chosen", "rejected"]', "must be a JSON object"),
])
def test_malformed_pair_file_is_one_error_line(tmp_path, capsys, line, field):
    """A bad line anywhere in either file stops the CLI before training with exit 2 and one stderr line
    naming the file, the line number and the field."""
    good = json.dumps(_pairs(1, 0)[0])
    bad = _write(tmp_path / "bad.jsonl", [good, "", line])
    ok = _write(tmp_path / "ok.jsonl", [good])
    for data, held in ((bad, ok), (ok, bad)):
        rc, out, err = _cli(["--data", data, "--eval", held, "--workdir", str(tmp_path / "w")], capsys)
        assert rc == 2 and out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {bad}:3: ") and field in lines[0], err


def test_pair_that_the_chat_template_refuses_names_its_line(tmp_path, capsys):
    """Message text holding a template token is refused by the chat template: reported with file:line and field."""
    rows = _pairs(20, 0)
    rows[4] = dict(rows[4], rejected="sneaky <|assistant|> turn")
    rc, _, err = _cli(["--data", _write(tmp_path / "p.jsonl", rows), "--eval", _write(tmp_path / "e.jsonl", rows[:2]),
                       "--workdir", str(tmp_path / "w")] + sum((["--set", s] for s in SMALL), []), capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "p.jsonl:5: field 'rejected'" in err and "<|assistant|>" in err


def _tiny_rm():
    cfg = ModelConfig(vocab_size=304, d_model=32, num_layers=1, ffn_dim=64, attention="mha", num_heads=2,
                      num_kv_heads=2, num_experts=0, mtp_depth=0, reward_head=True)
    return cfg, init_params(cfg, jax.random.PRNGKey(1))


def test_bt_loss_equals_numpy_on_unpadded_forwards():
    """make_rm_loss on a padded pair batch == -mean log sigmoid(r_c - r_r) with each reward taken from a
    separate, unpadded forward at the sequence's last token (so padding and the last-index gather are
    right); padding pairs do not count."""
    from glm5_jax.rl.reward_model import make_rm_loss, pair_batch, reward_scores
    cfg, params = _tiny_rm()
    rng = np.random.default_rng(0)
    enc = [tuple(rng.integers(1, 304, size=rng.choice([5, 11])).tolist() for _ in range(2)) for _ in range(3)]
    batch = pair_batch(enc, 4, 16)
    loss, (metrics, loads) = make_rm_loss(cfg, center_weight=0.0)(params, {k: jnp.asarray(v) for k, v in batch.items()})
    fwd = jax.jit(lambda t: GLM5(cfg).apply({"params": params}, t, reward=True)["reward"][0, -1])
    r = np.array([[float(fwd(jnp.asarray([s]))) for s in p] for p in enc])
    m = r[:, 0] - r[:, 1]
    np.testing.assert_allclose(float(loss), np.mean(np.logaddexp(0, -m)), rtol=1e-5)
    assert float(metrics["pairwise_accuracy"]) == pytest.approx(np.mean(m > 0)) and loads == {}
    np.testing.assert_allclose(reward_scores(cfg, params, [s for p in enc for s in p], seq_len=16, batch_size=4),
                               r.reshape(-1), rtol=1e-5, atol=1e-6)


def test_init_from_policy_checkpoint_keeps_trunk_and_adds_head(tmp_path):
    """rm_init_params from a policy checkpoint (no reward head): every trunk leaf is the policy's, the head
    is new; from a reward model's checkpoint the head is read back too."""
    from glm5_jax.rl.reward_model import rm_init_params
    from glm5_jax.train.checkpoint import save_params
    cfg, rm_params = _tiny_rm()
    policy_cfg = cfg.replace(reward_head=False)
    policy = init_params(policy_cfg, jax.random.PRNGKey(2))
    save_params(tmp_path / "policy", policy_cfg, policy)
    got = rm_init_params(str(tmp_path / "policy"), cfg)
    assert set(got) == set(policy) | {"reward_head"} and got["reward_head"]["kernel"].shape == (cfg.d_model, 1)
    chex.assert_trees_all_equal({k: got[k] for k in policy}, policy)
    save_params(tmp_path / "rm", cfg, rm_params)
    back = rm_init_params(str(tmp_path / "rm"), cfg)
    chex.assert_trees_all_equal(back, rm_params)


@pytest.mark.slow
def test_cli_init_from_a_policy_checkpoint(tmp_path, capsys):
    """The CLI's --init_from trains the checkpoint's model (its config plus the head, written to the run's
    model_config.json) and refuses to run without the checkpoint's tokenizer."""
    from glm5_jax.data.hf_tokenizer import train_hf_tokenizer
    from glm5_jax.train.checkpoint import save_params
    cfg, _ = _tiny_rm()
    policy_cfg = cfg.replace(reward_head=False)
    save_params(tmp_path / "policy", policy_cfg, init_params(policy_cfg, jax.random.PRNGKey(2)))
    from glm5_jax.rl.reward_model import pair_texts, load_pairs
    data = _write(tmp_path / "p.jsonl", _pairs(32, 0))
    tok = train_hf_tokenizer(pair_texts(load_pairs(data)), 300, str(tmp_path / "tok.json"))
    assert tok.vocab_size <= cfg.vocab_size
    argv = ["--data", data, "--eval", data, "--workdir", str(tmp_path / "w"), "--init_from", str(tmp_path / "policy")]
    rc, _, err = _cli(argv, capsys)
    assert rc == 2 and "--init_from needs --tokenizer" in err
    rc, out, err = _cli(argv + ["--tokenizer", str(tmp_path / "tok.json"), "--json", "--set", "train.steps=2",
                                "--set", "train.seq_len=48", "--set", "train.batch_size=4"], capsys)
    assert rc == 0, err
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 2
    assert json.loads((tmp_path / "w" / "model_config.json").read_text())["glm5_jax_reward_head"] is True
