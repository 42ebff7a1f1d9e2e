"""Agentic RL pieces without Ray: hash ring, staleness/refill, the agentic loss, the TITO gateway
(records equal a server's outputs bit for bit), the calculator and chain tasks, decode row buckets,
CPU pinning."""

import asyncio
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import collections
import os
import time

from glm5_jax.agentic.agent import (ChainTask, calculator, hop_probs, make_calc_task, make_chain_task, play,
                                    sft_example)
from glm5_jax.agentic.coordinator import HashRing, NoWorkers, filter_group
from glm5_jax.agentic.gateway import Gateway, TrajectoryRecord, records_to_batch
from glm5_jax.agentic.loss import agentic_loss, group_centered_advantages
from glm5_jax.rl.sft import CharVocab


def test_hash_ring_consistent_and_minimal_moves():
    ring = HashRing(["a", "b", "c"])
    keys = [f"g{i}/{k}" for i in range(300) for k in range(2)]
    before = {k: ring.route(k) for k in keys}
    assert before == {k: ring.route(k) for k in keys}          # deterministic
    counts = {n: sum(v == n for v in before.values()) for n in "abc"}
    assert min(counts.values()) > len(keys) / 10               # every worker gets a share
    ring.remove("b")
    after = {k: ring.route(k) for k in keys}
    # only the removed worker's keys move; the others keep their worker (cache reuse)
    assert all(after[k] == before[k] for k in keys if before[k] != "b")
    assert all(after[k] in ("a", "c") for k in keys)
    ring.remove("a"), ring.remove("c")
    with pytest.raises(NoWorkers):
        ring.route("x")


def _rec(tid, status="done", versions=(3,), reward=1.0):
    r = TrajectoryRecord(traj_id=tid, group_id="g")
    r.add_context([1, 2])
    for v in versions:
        r.add_generated([5], [-0.5], v)
    r.status, r.reward = status, reward
    return r


def test_filter_group_staleness_refill_and_drop():
    # version 5, tau 2: min_version 2 is stale (5 - 2 = 3 > 2); 3 is not
    recs = [_rec("a", versions=(3, 4)), _rec("b", versions=(2, 5)), _rec("c"), _rec("d", status="env_error")]
    kept, info = filter_group(recs, version=5, tau=2)
    # valid: a, c (2 of 4) -> not more than half -> dropped
    assert kept is None and info == {"stale": 1, "broken": 1, "refilled": 0, "dropped": 4}
    recs.append(_rec("e"))
    recs.append(_rec("f"))
    kept, info = filter_group(recs, version=5, tau=2)          # valid a, c, e, f: 4 of 6
    assert [r.traj_id for r in kept] == ["a", "c", "e", "f", "a", "c"]
    assert [r.refill_of for r in kept] == [None] * 4 + ["a", "c"]
    assert info == {"stale": 1, "broken": 1, "refilled": 2, "dropped": 0}
    assert recs[0].refill_of is None                           # the originals are untouched


def test_agentic_loss_matches_reference_and_masks():
    rng = np.random.default_rng(0)
    b, t = 3, 6
    logp = rng.normal(-1.0, 0.3, (b, t)).astype(np.float32)
    infer = (logp + rng.normal(0, 0.3, (b, t))).astype(np.float32)
    infer[0, 0] = -np.inf                                      # garbage under the mask must not leak
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)
    mask[0, 0] = 0
    mask[2] = 0                                                # an empty row contributes 0
    adv = np.array([1.0, -2.0, 0.5], np.float32)
    loss, met = agentic_loss(logp, None, infer, adv, mask, eps_low=0.2, eps_high=0.28)
    # independent reference, token by token
    total, inside_n, n = 0.0, 0, 0
    grad_ref = np.zeros_like(logp)
    for i in range(b):
        cnt = mask[i].sum()
        for j in range(t):
            if not mask[i, j]:
                continue
            n += 1
            r = float(np.exp(np.float64(logp[i, j]) - infer[i, j]))
            f = r if 0.8 < r < 1.28 else 0.0
            inside_n += f != 0
            total += f * adv[i] * logp[i, j] / cnt
            grad_ref[i, j] = -f * adv[i] / cnt / b
    np.testing.assert_allclose(float(loss), -total / b, rtol=1e-5)
    np.testing.assert_allclose(float(met["masked_frac"]), 1 - inside_n / n, rtol=1e-6)
    g = jax.grad(lambda lp: agentic_loss(lp, None, infer, adv, mask)[0])(jnp.asarray(logp))
    assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_allclose(np.asarray(g), grad_ref, rtol=1e-5, atol=1e-7)


def test_group_centered_advantages():
    np.testing.assert_allclose(np.asarray(group_centered_advantages([1, 0, 0, 1, 1, 1], 3)),
                               [2 / 3, -1 / 3, -1 / 3, 0, 0, 0], atol=1e-6)
    with pytest.raises(ValueError, match="group_size=4"):
        group_centered_advantages([1, 0, 1], 4)


def test_records_to_batch_layout():
    r = TrajectoryRecord(traj_id="x", group_id="g")
    r.add_context([1, 7, 8])              # prompt
    r.add_generated([9, 4], [-0.25, -1.5], 2)
    r.add_context([6])                    # observation: masked
    r.add_generated([3], [-0.125], 3)
    b = records_to_batch([r], [0.5], seq_len=8)
    np.testing.assert_array_equal(b["inputs"][0], [1, 7, 8, 9, 4, 6, 3, 0])
    np.testing.assert_array_equal(b["targets"][0], [7, 8, 9, 4, 6, 3, 0, 0])
    np.testing.assert_array_equal(b["mask"][0], [0, 0, 1, 1, 0, 1, 0, 0])
    np.testing.assert_array_equal(b["infer_logp"][0], [0, 0, -0.25, -1.5, 0, -0.125, 0, 0])
    np.testing.assert_array_equal(b["versions"][0], [-1, -1, 2, 2, -1, 3, -1, -1])
    assert r.min_version == 2 and r.generated_tokens == 3
    with pytest.raises(ValueError, match="seq_len=4"):
        records_to_batch([r], [0.5], seq_len=4)


def test_calculator_task_and_sft_example():
    vocab = CharVocab()
    t = make_calc_task(random.Random(3))
    assert calculator(t.expr) == str(t.answer)
    assert calculator("1/0") == "" and calculator("import os") == ""
    ex = sft_example(t, vocab)[0]
    text = vocab.decode(ex.ids)
    assert text == f"{t.expr}=({t.expr})\n>{t.answer}\n{t.answer}\n"
    trained = vocab.decode([i for i, m in zip(ex.ids, ex.loss_mask) if m])
    assert trained == f"({t.expr})\n{t.answer}\n"              # the observation is never trained


def test_chain_task_tool_transcript_and_hop_law():
    vocab = CharVocab()
    t = ChainTask(keys=(371, 552, 904), answer=81)
    assert t.prompt == "371:" and t.hops == 3
    assert [t.tool(a) for a in ("371", "552", "904", "999", "")] == ["552", "904", "=81", "", ""]
    ex = sft_example(t, vocab)[0]
    assert vocab.decode(ex.ids) == "371:(371)\n>552\n(552)\n>904\n(904)\n>=81\n81\n"
    assert len(ex.ids) == 8 + 11 * t.hops          # the length bound async_vs_sync checks its context against
    trained = vocab.decode([i for i, m in zip(ex.ids, ex.loss_mask) if m])
    assert trained == "(371)\n(552)\n(904)\n81\n"       # observations are never trained
    # P(k) ~ k^-alpha, closed form for max_hops=2, alpha=1: (1, 1/2) / (3/2)
    np.testing.assert_allclose(hop_probs(2, 1.0), [2 / 3, 1 / 3])
    np.testing.assert_allclose(hop_probs(3, 0.0), [1 / 3] * 3)
    with pytest.raises(ValueError, match="max_hops"):
        hop_probs(0, 1.0)
    rng = random.Random(0)
    tasks = [make_chain_task(rng, max_hops=4, alpha=1.5) for _ in range(4000)]
    for tk in tasks[:50]:
        assert len(set(tk.keys)) == tk.hops and all(100 <= k <= 999 for k in tk.keys) and 10 <= tk.answer <= 99
    freq = collections.Counter(tk.hops for tk in tasks)
    for k, p in zip(range(1, 5), hop_probs(4, 1.5)):
        assert abs(freq[k] / len(tasks) - p) < 4 * (p * (1 - p) / len(tasks)) ** 0.5


def test_play_chain_task_multi_hop_with_its_own_tool():
    """A scripted policy that follows the chain: one tool call per hop, observations masked, reward 1;
    a wrong final answer scores 0."""
    vocab = CharVocab()
    t = ChainTask(keys=(371, 552), answer=81)

    def policy(answer):
        def generate(traj_id, request_id, ids):
            ctx = vocab.decode(ids)
            last = ctx.rstrip("\n").rsplit("\n", 1)[-1]
            if last.endswith(":"):
                reply = f"({last[:-1]})\n"
            elif last.startswith(">="):
                reply = f"{answer}\n"
            else:
                reply = f"({last[1:]})\n"
            toks = vocab.encode(reply)
            return {"tokens": toks, "logprobs": [-0.25] * len(toks), "version": 3, "finish_reason": "stop"}
        return generate

    rec = play(Gateway(), policy(81), "t0", "g", t, vocab, max_turns=4, max_len=40, max_new_tokens=6)
    assert rec.status == "done" and rec.reward == 1.0
    assert vocab.decode(rec.tokens) == "371:(371)\n>552\n(552)\n>=81\n81\n"
    gen = vocab.decode([i for i, m in zip(rec.tokens, rec.mask) if m])
    assert gen == "(371)\n(552)\n81\n" and rec.min_version == 3
    assert play(Gateway(), policy(80), "t1", "g", t, vocab, max_turns=4, max_len=40).reward == 0.0
    # too few turns for the chain: the episode ends unanswered, reward 0
    assert play(Gateway(), policy(81), "t2", "g", t, vocab, max_turns=2, max_len=40).reward == 0.0


def test_server_row_buckets_and_pinning_validation():
    from glm5_jax.agentic.server import RolloutServer, pin_process
    from glm5_jax.config import ModelConfig
    vocab = CharVocab()
    cfg = ModelConfig(vocab_size=vocab.padded_size(), d_model=32, num_layers=1, ffn_dim=64, attention="mha",
                      num_heads=2, num_kv_heads=2, num_experts=0, mtp_depth=0, attn_chunk=64)
    from glm5_jax import model
    params = model.init_params(cfg, jax.random.PRNGKey(0))      # never decoded here: construction only
    assert RolloutServer(cfg, params, max_batch=32).row_buckets == [4, 8, 16, 32]
    assert RolloutServer(cfg, params, max_batch=12).row_buckets == [4, 8, 12]
    assert RolloutServer(cfg, params, max_batch=3).row_buckets == [3]
    with pytest.raises(ValueError, match="row_buckets"):
        RolloutServer(cfg, params, max_batch=8, row_buckets=(4, 16))
    assert RolloutServer(cfg, params, max_len=104, max_new_tokens=6).width_buckets == [32, 64, 98]
    assert RolloutServer(cfg, params, max_len=40, max_new_tokens=6).width_buckets == [32, 34]
    with pytest.raises(ValueError, match="width_buckets"):
        RolloutServer(cfg, params, max_len=40, max_new_tokens=6, width_buckets=(16,))
    assert pin_process(None) is None and pin_process(()) is None
    with pytest.raises(ValueError, match="cpus"):
        pin_process([os.cpu_count() + 5])
    before = os.sched_getaffinity(0)
    prev = pin_process([min(before)])
    try:
        assert prev == before and os.sched_getaffinity(0) == {min(before)}
    finally:
        pin_process(sorted(prev))
    assert os.sched_getaffinity(0) == before


def test_gateway_records_equal_server_outputs_bit_for_bit():
    """Trajectories played through the gateway against a (local, Ray-free) RolloutServer on the engine:
    every generated segment in the records is exactly what the server returned for that request (with
    its per-token versions); concurrent requests share decode steps, and nothing compiles after warm-up."""
    from glm5_jax.agentic.server import RolloutServer
    from glm5_jax.config import ModelConfig
    from glm5_jax.model import init_params
    vocab = CharVocab()
    # plain multi-head attention: the cheapest decode to compile (the server is attention-agnostic;
    # the DSA policy is served in test_agentic_ray.py and async_vs_sync)
    cfg = ModelConfig(vocab_size=vocab.padded_size(), d_model=32, num_layers=1, ffn_dim=64, attention="mha",
                      num_heads=2, num_kv_heads=2, num_experts=0, mtp_depth=0, attn_chunk=64)
    server = RolloutServer(cfg, init_params(cfg, jax.random.PRNGKey(0)), max_batch=8, max_len=40,
                           max_new_tokens=6, stop_tokens=(vocab.newline_id,), keep_outputs=True, version=7,
                           width_buckets=(34,))
    # every step width compiled up front: the row buckets (decode-only steps) and max_batch + each width
    # bucket (steps with a prompt piece)
    assert server.warmup() == {"widths": [4, 8, 8 + 34], "rows": [4, 8]}
    n0, s0 = server.engine.compiled_programs(), server.stats
    loop = asyncio.new_event_loop()
    gateway = Gateway()
    requests = {}

    def generate(traj_id, request_id, ids):
        requests.setdefault(traj_id, []).append(request_id)
        return asyncio.run_coroutine_threadsafe(server.generate(request_id, ids), loop).result()

    import threading
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    rng = random.Random(0)
    tasks = [make_calc_task(rng) for _ in range(4)]
    from concurrent.futures import ThreadPoolExecutor
    # the calculator always answers "(": forces multi-turn records with masked observations
    server.pause()            # the four first turns queue up, then join the batch together
    with ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(play, gateway, generate, f"t{i}", "g", tasks[i], vocab, max_turns=3, max_len=40,
                          max_new_tokens=6) for i in range(4)]
        for _ in range(6000):
            if server.engine.queue_length == 4:
                break
            time.sleep(0.01)
        assert server.engine.queue_length == 4
        server.resume()
        recs = [f.result() for f in futs]
    loop.call_soon_threadsafe(loop.stop)
    th.join(timeout=5)
    served = server.outputs()
    st = {k: server.stats[k] - s0[k] for k in s0}
    server.close()
    assert st["requests"] == sum(len(r) for r in requests.values()) == len(served)
    assert st["slot_steps"] > st["steps"]          # concurrent requests shared decode steps
    assert server.engine.compiled_programs() == n0
    for rec in recs:
        segs, cur = [], None
        for tok, lp, m, v in zip(rec.tokens, rec.logp, rec.mask, rec.versions):
            if m and cur is None:
                cur = ([], [], [])
                segs.append(cur)
            if m:
                cur[0].append(tok)
                cur[1].append(lp)
                cur[2].append(v)
                assert v == 7
            else:
                cur = None
        outs = [served[rid] for rid in requests[rec.traj_id]]
        # a request may return an empty segment? never: max_new >= 1, so one segment per request
        assert len(segs) == len(outs)
        for (toks, lps, vs), out in zip(segs, outs):
            np.testing.assert_array_equal(np.asarray(toks, np.int32), out["tokens"])
            assert np.asarray(lps, np.float32).tobytes() == out["logprobs"].tobytes()   # bit for bit
            assert vs == out["versions"] and out["version"] == 7
        assert rec.tokens[:len(tasks[0].prompt) + 1][0] == vocab.bos_id


def test_server_request_straddling_a_weight_push_reports_the_oldest_version():
    """load_weights while a request decodes: the engine uses the new weights from the first step it has not
    dispatched yet (steps overlap: when the third token is delivered the step making the fourth already
    runs on the old weights), each token keeps the version that produced it, the request reports the OLDEST ("version" 7), the
    gateway record keeps the per-token versions (the staleness filter counts from 7), and a request after
    the push is fresh greedy decoding with the new weights (its context is not reused from rows the old
    weights wrote)."""
    from glm5_jax.agentic.server import RolloutServer
    from glm5_jax.config import ModelConfig
    from glm5_jax.infer import generate as reference
    from glm5_jax.model import init_params
    vocab = CharVocab()
    cfg = ModelConfig(vocab_size=vocab.padded_size(), d_model=32, num_layers=1, ffn_dim=64, attention="mha",
                      num_heads=2, num_kv_heads=2, num_experts=0, mtp_depth=0, attn_chunk=64)
    p7, p8 = init_params(cfg, jax.random.PRNGKey(0)), init_params(cfg, jax.random.PRNGKey(1))
    server = RolloutServer(cfg, p7, max_batch=4, max_len=40, max_new_tokens=6, temperature=0.0, version=7,
                           width_buckets=(34,))
    server.warmup()

    class PushAfterThirdToken:          # the engine's metrics hook: called in its thread after every token
        def observe_token(self, h, now):
            if h.id == "r0" and len(h.tokens) == 3:
                server.load_weights(8, p8)

        def observe_engine(self, engine):
            pass

        def observe_finish(self, h):
            pass

    server.engine.metrics = PushAfterThirdToken()
    loop = asyncio.new_event_loop()
    import threading
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    call = lambda rid, ids: asyncio.run_coroutine_threadsafe(server.generate(rid, ids), loop).result(120)
    try:
        prompt = [vocab.bos_id] + vocab.encode("12+34=")
        gateway = Gateway()
        gateway.open("t", "g", prompt)
        out = gateway.generate("t", lambda ids: call("r0", ids))
        assert out["versions"] == [7, 7, 7, 7, 8, 8] and out["version"] == 7
        rec = gateway.finish("t", 1.0, "done")
        assert rec.versions == [-1] * len(prompt) + [7, 7, 7, 7, 8, 8] and rec.min_version == 7
        kept, info = filter_group([rec] * 3, version=10, tau=2)      # 10 - 7 > 2: stale, although 10 - 8 = 2
        assert kept is None and info["stale"] == 3
        old = reference(cfg, p7, [prompt], max_new_tokens=6, temperature=0.0)
        assert out["tokens"][:4].tolist() == old.tokens[0, :4].tolist()
        assert not np.allclose(out["logprobs"][4:], old.logprobs[0, 4:], atol=1e-3)   # the new weights decoded
        reused = server.stats["reused_tokens"]
        again = call("r1", prompt + out["tokens"].tolist() + vocab.encode("5"))
        fresh = reference(cfg, p8, [prompt + out["tokens"].tolist() + vocab.encode("5")], max_new_tokens=6,
                          temperature=0.0)
        assert again["versions"] == [8] * 6 and server.stats["reused_tokens"] == reused
        assert again["tokens"].tolist() == fresh.tokens[0].tolist()
        np.testing.assert_allclose(again["logprobs"], fresh.logprobs[0], atol=1e-5)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        th.join(timeout=5)
        server.close()


def test_play_with_the_calculator_service_and_env_crash():
    """The agent loop against the environment service (glm5_jax.agentic.envs) with a scripted policy:
    observation tokens are context (mask 0); a dead service makes the sample broken (env_error)."""
    from glm5_jax.agentic.agent import service_calculator
    from glm5_jax.agentic.envs import serve
    vocab = CharVocab()
    task = make_calc_task(random.Random(5))
    replies = [f"({task.expr})\n", f"{task.answer}\n"]

    def generate(traj_id, request_id, ids):
        toks = vocab.encode(replies[int(request_id.rsplit(".", 1)[1])])
        return {"tokens": toks, "logprobs": [-0.5] * len(toks), "version": 1, "finish_reason": "stop"}

    env = serve()
    try:
        rec = play(Gateway(), generate, "t0", "g", task, vocab, tool=service_calculator(env.url))
    finally:
        env.close()
    assert rec.status == "done" and rec.reward == 1.0
    obs = vocab.encode(f">{task.answer}\n")
    assert vocab.decode(rec.tokens) == task.prompt + replies[0] + f">{task.answer}\n" + replies[1]
    assert rec.mask == [0] * (len(task.prompt) + 1) + [1] * len(replies[0]) + [0] * len(obs) + [1] * len(replies[1])
    rec = play(Gateway(), generate, "t1", "g", task, vocab, tool=service_calculator(env.url, timeout=2))
    assert rec.status == "env_error" and rec.reward == 0.0


@pytest.mark.parametrize("kw,needle", [({"mode": "both"}, "mode"), ({"in_flight_groups": 1, "groups_per_step": 2},
                                        "in_flight_groups"), ({"tau": -1}, "tau"),
                                       ({"kill_worker_at_step": 2, "servers": 1}, "servers >= 2"),
                                       ({"agent_threads": 8, "in_flight_groups": 4, "group_size": 4}, "agent_threads"),
                                       ({"trainer_cpus": (0,), "server_cpus": (0, 1)}, "overlap"),
                                       ({"max_batch": 16, "row_buckets": (4, 8)}, "row_buckets"),
                                       ({"max_len": 40, "max_new_tokens": 6, "width_buckets": (32,)}, "width_buckets")])
def test_agentic_config_errors_name_the_field(kw, needle):
    from glm5_jax.agentic.trainer import AgenticConfig
    with pytest.raises(ValueError, match=needle):
        AgenticConfig(**kw)
