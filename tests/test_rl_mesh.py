"""Colocated RL on 8 forced CPU devices (a subprocess: the device count is fixed at JAX start-up).

Against the unsharded run (one device, the reference), on the mesh data:2,fsdp:2,expert:2:
* ``run_grpo`` (GRPO + IcePop under an int8 rollout mismatch, two minibatches per step) logs the same
  losses and metrics (rtol 1e-5) and samples the very same token ids at every step (``on_rollout``);
  the mesh run's rows report the bytes its syncs moved between devices (the all-gather of the
  fsdp-split policy into the replicated serving layout, computed independently here from the shapes)
  and none through the host;
* a weight sync runs under JAX's transfer guard with host <-> device transfers disallowed (so no array
  goes through the host), leaves every leaf in the serving layout, and the synced engine then decodes
  exactly (tokens and log-probs, bitwise) as a fresh engine built from the new weights;
* the rollout engine on one device samples bit for bit what ``infer.generate`` samples;
* a chunked sync (``reshard_chunk_bytes``: whole leaves grouped, layer stacks cut into slices) of a MoE
  policy gives every leaf of the one-program sync bitwise, in the serving layout, with the transfer guard
  on; each of its programs makes at most one chunk of a device's shards (or one layer where a layer is
  larger) and its scratch is at most twice that, where the one-program sync's scratch is larger;
* a distillation teacher and a reward model placed on the mesh score as on one device (1e-5); a teacher
  equal to the student gives advantages of exactly 0 on the mesh; the
  judge's server (``RolloutServer(mesh=...)``, called as ``GenerativeJudge`` calls it) answers as on one.
"""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMMON = textwrap.dedent("""
    import dataclasses, random
    import jax, numpy as np
    from glm5_jax.config import ModelConfig
    from glm5_jax.infer import generate
    from glm5_jax.model import init_params
    from glm5_jax.parallel.distributed import build_mesh
    from glm5_jax.rl.program import TIMING_KEYS, RLConfig, run_grpo
    from glm5_jax.rl.rollout import rollout_params
    from glm5_jax.rl.rollout_engine import RolloutEngine
    from glm5_jax.rl.sft import CharVocab
    from glm5_jax.sharding import LOGICAL_RULES, param_shardings
    assert len(jax.devices()) == 8
    V = CharVocab()
    cfg = ModelConfig(vocab_size=V.padded_size(), d_model=32, num_layers=2, num_heads=2, q_lora_rank=16,
                      kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=4, v_head_dim=16, ffn_dim=64,
                      attention="dsa", index_topk=4, index_n_heads=2, index_head_dim=8, num_experts=0,
                      mtp_depth=0, attn_chunk=16, initializer_range=0.1)
    params = init_params(cfg, jax.random.PRNGKey(0))
    mesh = build_mesh("data:2,fsdp:2,expert:2")

""")

GRPO = COMMON + textwrap.dedent("""
    @dataclasses.dataclass
    class Digits:       # reward: the completion holds the prompt's digit (varies within a group: non-zero advantages)
        prompt: str
        def score(self, text):
            return (1.0, "correct") if self.prompt[-2] in text else (0.0, "wrong")

    def task(rng):
        return Digits(f"{rng.randint(1, 9)}+{rng.randint(1, 9)}=")

    rl = RLConfig(loss="icepop", steps=2, prompts_per_step=4, group_size=4, max_new_tokens=4, max_prompt_len=8,
                  minibatches=2, learning_rate=3e-3, mismatch="int8")
    runs = {}
    for name, m in (("one", None), ("mesh", mesh)):
        toks = []
        r = run_grpo(cfg, params, rl, task, V, mesh=m, log=lambda s: None,
                     on_rollout=lambda step, ro: toks.append((ro.tokens.copy(), ro.infer_logp.copy())))
        runs[name] = (r["history"], toks)
    (h1, t1), (hm, tm) = runs["one"], runs["mesh"]
    assert any(abs(h["loss"]) > 1e-4 for h in h1), [h["loss"] for h in h1]     # the comparison is not vacuous
    for a, b in zip(h1, hm):
        for k in ("loss", "pop_frac", "clip_frac", "mismatch_kl", "grad_norm", "update_norm", "reward_mean"):
            np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-7, err_msg=k)
    for (ta, la), (tb, lb) in zip(t1, tm):
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_allclose(lb, la, atol=1e-5)
    # bytes a sync moves: the training layout splits leaves over fsdp (2 ways); serving replicates them,
    # so each device receives every leaf minus the part it holds
    train_sh = param_shardings(cfg, mesh, LOGICAL_RULES)
    held = sum(int(np.prod(sh.shard_shape(leaf.shape))) * 4
               for leaf, sh in zip(jax.tree.leaves(params), jax.tree.leaves(train_sh)))
    full = sum(leaf.size * 4 for leaf in jax.tree.leaves(params))
    assert all(h["sync_host_bytes"] == 0 for h in hm)
    assert hm[0]["sync_bytes_moved"] == 8 * (full - held), (hm[0]["sync_bytes_moved"], full, held)
    assert h1[0]["sync_bytes_moved"] == 0                      # one device: the copy stays where it is
    assert hm[0]["rollout_cache_bytes_per_device"] * 8 == h1[0]["rollout_cache_bytes_per_device"]
    assert all(k in hm[0] for k in ("rollout_peak_bytes_per_device", "update_resident_bytes_per_device"))

    print("OK")
""")

SYNC = COMMON + textwrap.dedent("""
    train_sh = param_shardings(cfg, mesh, LOGICAL_RULES)
    # a weight sync moves nothing through the host, and then decodes as an engine built from the new weights
    new = jax.tree.map(lambda x: x * 1.01, params)
    new_train = jax.device_put(new, train_sh)                 # the trainer's layout
    prompts = [V.encode(s, bos=True) for s in ("1+2=", "3+4=", "15+7=", "9=") * 2]
    kw = dict(max_new_tokens=5, temperature=1.0, seed=11, stop_tokens=(V.newline_id,))
    eng = RolloutEngine(cfg, mesh, mismatch="int8")
    eng.sync(jax.device_put(params, train_sh), 0)
    eng.generate(prompts, **kw)
    with jax.transfer_guard_host_to_device("disallow"), jax.transfer_guard_device_to_host("disallow"):
        rep = eng.sync(new_train, 1)
    assert rep["host_bytes"] == 0 and rep["bytes_moved"] > 0
    for leaf, sh in zip(jax.tree.leaves(eng.params), jax.tree.leaves(eng.param_shardings)):
        assert leaf.sharding.is_equivalent_to(sh, leaf.ndim), (leaf.sharding, sh)
    got = eng.generate(prompts, **kw)
    fresh = RolloutEngine(cfg, mesh, mismatch="int8")
    fresh.sync(jax.device_put(new, jax.devices()[0]), 0)
    want = fresh.generate(prompts, **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)

    # one device: the engine's rollouts are infer.generate's, bit for bit
    one = RolloutEngine(cfg, None, mismatch="int8")
    one.sync(params, 0)
    a = one.generate(prompts, **kw)
    b = generate(cfg, rollout_params(params, "int8"), prompts, **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)

    # the distillation teacher and the reward model, resident on the mesh, score as on one device
    from glm5_jax.rl.distill import make_teacher_advantage_fn
    from glm5_jax.rl.reward_model import RewardModel
    rs = np.random.default_rng(0)
    batch = {"inputs": rs.integers(1, V.padded_size(), (8, 9)).astype(np.int32),
             "targets": rs.integers(1, V.padded_size(), (8, 9)).astype(np.int32),
             "mask": np.ones((8, 9), np.float32), "old_logp": np.full((8, 9), -3.0, np.float32)}
    adv = [make_teacher_advantage_fn(cfg, {"a": new}, lambda t: "a", mesh=m)([None] * 8, batch) for m in (None, mesh)]
    np.testing.assert_allclose(adv[1], adv[0], rtol=1e-5, atol=1e-5)
    assert np.abs(adv[0]).max() > 0.1
    # a teacher equal to the (mesh-trained) student gives advantages of exactly 0, as on one device
    from glm5_jax.rl.program import token_logprobs
    student = jax.device_put(new, train_sh)
    own = dict(batch, old_logp=np.asarray(token_logprobs(cfg, student, jax.numpy.asarray(batch["inputs"]),
                                                         jax.numpy.asarray(batch["targets"]))))
    assert not make_teacher_advantage_fn(cfg, {"a": new}, lambda t: "a", mesh=mesh)([None] * 8, own).any()
    rcfg = cfg.replace(reward_head=True)
    rparams = init_params(rcfg, jax.random.PRNGKey(1))
    scores = [RewardModel(rcfg, rparams, seq_len=12, batch_size=8, mesh=m)(prompts[:6]) for m in (None, mesh)]
    np.testing.assert_allclose(scores[1], scores[0], rtol=1e-5, atol=1e-6)
    assert np.ptp(scores[0]) > 0

    # the judge's server (a RolloutServer, what GenerativeJudge calls through serve_local) on the mesh
    # answers as on one device
    from glm5_jax.agentic.server import RolloutServer
    from glm5_jax.rl.judge import serve_local
    outs = []
    for m in (None, "data:2,fsdp:2,expert:2"):
        server = RolloutServer(cfg, params, max_batch=8, max_len=24, max_new_tokens=5, width_buckets=(19,), mesh=m)
        gen, close = serve_local(server)
        try:
            outs.append(gen("t0", "t0@0", prompts[2]))
        finally:
            close()
            server.close()
    assert outs[0]["tokens"].tolist() == outs[1]["tokens"].tolist()
    np.testing.assert_allclose(outs[1]["logprobs"], outs[0]["logprobs"], atol=1e-5)
    print("OK")
""")


CHUNKED = COMMON + textwrap.dedent("""
    from glm5_jax.rl.rollout_engine import sync_plan
    # a MoE policy: expert stacks [layers, experts, in, out] with experts split over `expert` in serving
    moe = cfg.replace(num_layers=5, num_experts=4, first_k_dense=1, moe_ffn_dim=32)
    src = jax.device_put(init_params(moe, jax.random.PRNGKey(3)), param_shardings(moe, mesh, LOGICAL_RULES))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), src)
    bound = 3000                               # bytes of a device's shards per program
    for mode in ("int8",):                     # the mode with the quantiser in the programs ("none": identity)
        whole = RolloutEngine(moe, mesh, mismatch=mode)
        chunked = RolloutEngine(moe, mesh, mismatch=mode, reshard_chunk_bytes=bound)
        a = whole.sync(src, 0)
        with jax.transfer_guard_host_to_device("disallow"), jax.transfer_guard_device_to_host("disallow"):
            b = chunked.sync(src, 0)
        assert a["programs"] == 1 and b["programs"] > 10, (a, b)
        assert {k: v for k, v in a.items() if k not in ("programs", "seconds")} == \
            {k: v for k, v in b.items() if k not in ("programs", "seconds")}
        for x, y, sh in zip(jax.tree.leaves(whole.params), jax.tree.leaves(chunked.params),
                            jax.tree.leaves(chunked.param_shardings)):
            assert y.sharding.is_equivalent_to(sh, y.ndim), (y.sharding, sh)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        # each program's share of a device's copy, from the shapes: a leaf group's shards, or `rows` of a
        # stack's leading axis (never split in serving) of one leaf's shard
        shardings = jax.tree.leaves(chunked.param_shardings)
        def dev_bytes(j):
            leaf = jax.tree.leaves(abstract)[j]
            return int(np.prod(shardings[j].shard_shape(leaf.shape))) * leaf.dtype.itemsize
        plan = sync_plan(jax.tree.leaves(abstract), shardings, bound)
        assert sorted(j for c in plan for j in (c[1] if c[0] == "leaves" else [c[1]])) == list(range(len(shardings)))
        assert sum(1 if c[0] == "leaves" else jax.tree.leaves(abstract)[c[1]].shape[0] // c[2] for c in plan) == \
            b["programs"]
        lowered = chunked.lower_sync(abstract)
        assert [c for c, _, _ in lowered] == plan
        temps = []
        for c, low, runs in lowered:
            if c[0] == "leaves":
                share = sum(dev_bytes(j) for j in c[1])
                assert share <= bound or len(c[1]) == 1, (c, share)
            else:
                layer = dev_bytes(c[1]) // jax.tree.leaves(abstract)[c[1]].shape[0]
                share = c[2] * layer
                assert share <= max(bound, layer) and runs * c[2] == jax.tree.leaves(abstract)[c[1]].shape[0]
            temp = low.compile().memory_analysis().temp_size_in_bytes
            assert temp <= 2 * share + 64, (c, temp, share)       # gathered inputs + the quantiser's scratch
            temps.append(temp)
        print("programs", b["programs"], "distinct", len(plan), "max temp", max(temps))
        one = whole.lower_sync(abstract)
        assert len(one) == 1 and one[0][0] is None
        whole_temp = one[0][1].compile().memory_analysis().temp_size_in_bytes
        print("one-program temp", whole_temp)
        assert whole_temp > 4 * max(temps)
    print("OK")
""")


def _run(script):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]


@pytest.mark.slow   # ~55 s: a GRPO run on 8 fake devices and on one (the chunked-sync test below is the fast mesh check)
def test_colocated_grpo_on_a_mesh_matches_one_device():
    _run(GRPO)


@pytest.mark.slow   # ~45 s: sync under the transfer guard, teacher / reward model / judge on 8 fake devices
def test_sync_is_device_to_device_and_scorers_on_the_mesh_match_one_device():
    _run(SYNC)


def test_chunked_sync_equals_the_one_program_sync_and_bounds_each_program():
    _run(CHUNKED)


def test_optimizer_state_offloaded_during_rollouts_gives_the_same_run():
    """RLConfig.offload_optimizer (in this process, one device): the optimizer state sits in host memory
    (pinned_host) from the sync to the update and comes back in its own layout, so every row but the
    rollout phase's memory equals the run without it, bitwise, and that phase holds exactly the
    optimizer state's bytes less."""
    import jax
    import numpy as np

    from glm5_jax.model import init_params
    from glm5_jax.rl.program import TIMING_KEYS, make_rl_optimizer, run_grpo
    from glm5_jax.rl.tasks import arithmetic_task
    from glm5_jax.train.state import per_device_bytes
    from tests.test_rl_faults import CFG as cfg
    from tests.test_rl_faults import RL, VOCAB as vocab
    rl = RL.replace(steps=2, mismatch="int8")
    params = init_params(cfg, jax.random.PRNGKey(0))
    runs = [run_grpo(cfg, params, rl.replace(offload_optimizer=o), lambda r: arithmetic_task(r, 1), vocab,
                     log=lambda m: None) for o in (False, True)]
    peak = "rollout_peak_bytes_per_device"
    opt = per_device_bytes(make_rl_optimizer(params, rl, cfg)[0].init(params))
    for a, b in zip(runs[0]["history"], runs[1]["history"]):
        assert {k: v for k, v in a.items() if k not in TIMING_KEYS + (peak,)} == \
            {k: v for k, v in b.items() if k not in TIMING_KEYS + (peak,)}
        assert a[peak] - b[peak] == opt > 0
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(jax.device_get(runs[0]["params"])),
                                                    jax.tree.leaves(jax.device_get(runs[1]["params"]))))
