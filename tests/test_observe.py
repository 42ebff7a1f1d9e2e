"""glm5_jax.train.observe: TensorBoard event files, profiler traces, tokens/s and MFU, primary-only writes."""

import glob
import os
import struct
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import chips
from glm5_jax.config import preset
from glm5_jax.flops import estimate
from glm5_jax.train import TrainConfig
from glm5_jax.train import observe
from glm5_jax.train.observe import RunObserver

CFG = preset("tiny")
TCFG = TrainConfig(steps=20, batch_size=4, seq_len=32)


def read_events(logdir):
    """Every (tag, step, value) scalar in the TFRecord event files under logdir, parsed by hand: each
    record is u64 length, u32 masked crc32c(length), data, u32 masked crc32c(data)."""
    from tensorboardX.crc32c import crc32c
    from tensorboardX.proto.event_pb2 import Event

    def masked(data):
        c = crc32c(data)
        return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    out, files = [], sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*")))
    assert files, f"no event file in {logdir}"
    for path in files:
        buf = open(path, "rb").read()
        i = 0
        while i < len(buf):
            header = buf[i:i + 8]
            (n,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", buf[i + 8:i + 12])[0] == masked(header)
            data = buf[i + 12:i + 12 + n]
            assert struct.unpack("<I", buf[i + 12 + n:i + 16 + n])[0] == masked(data)
            i += 16 + n
            ev = Event.FromString(data)
            if ev.HasField("session_log"):
                out.append(("session_log", ev.step, ev.session_log.status))
            for v in ev.summary.value:
                out.append((v.tag, ev.step, v.simple_value))
    return out


def test_event_files_hold_every_scalar(tmp_path):
    obs = RunObserver(str(tmp_path), model_cfg=CFG, tcfg=TCFG)     # one process: primary by default
    for step, loss in ((1, 5.0), (2, 4.5), (3, 4.25)):
        perf = obs.record(step, {"step": step, "loss": jnp.float32(loss), "grad_norm": np.float32(step),
                                 "hist": np.ones(3), "name": "x"}, step_seconds=0.5 * step)
        assert perf["tokens_per_s"] == pytest.approx(4 * 32 / (0.5 * step))
        assert perf["mfu"] is None                        # CPU: no known peak
    obs.close()
    events = read_events(tmp_path / "tensorboard")
    by_tag = {}
    for tag, step, value in events:
        by_tag.setdefault(tag, {})[step] = value
    assert by_tag["loss"] == {1: 5.0, 2: 4.5, 3: 4.25}
    assert by_tag["grad_norm"] == {1: 1.0, 2: 2.0, 3: 3.0}
    assert by_tag["step_time_s"] == {1: 0.5, 2: 1.0, 3: 1.5}
    assert by_tag["tokens_per_s"][2] == pytest.approx(128.0)
    assert set(by_tag) == {"loss", "grad_norm", "step_time_s", "tokens_per_s", "session_log"}  # no mfu/arrays/str


def test_resumed_run_purges_events_past_its_first_step(tmp_path):
    """A restart at step 3 writes SessionLog(START) at step 3: TensorBoard then hides the older run's
    events at steps >= 3 (what it logged after the restored checkpoint)."""
    from tensorboardX.proto.event_pb2 import SessionLog
    obs = RunObserver(str(tmp_path), model_cfg=CFG, tcfg=TCFG, primary=True)
    obs.record(3, {"loss": 1.0}, step_seconds=1.0)
    obs.close()
    assert ("session_log", 3, SessionLog.START) in read_events(tmp_path / "tensorboard")


def test_mfu_closed_form_for_a_fake_device_kind(tmp_path, monkeypatch):
    monkeypatch.setitem(chips.CHIPS, "fake", chips.Chip("fake", chips.GiB, 2e12, device_kinds=("Fake TPU",)))
    mesh = types.SimpleNamespace(devices=np.array(jax.devices() * 4))     # only .devices is read
    obs = RunObserver(str(tmp_path), model_cfg=CFG, tcfg=TCFG, mesh=mesh, primary=False, device_kind="Fake TPU")
    perf = obs.record(1, {"loss": 1.0}, step_seconds=0.25)
    flops = estimate(CFG, TCFG.seq_len)["train_flops_per_token"]
    assert perf["mfu"] == pytest.approx(flops * (4 * 32 / 0.25) / (4 * 2e12))
    assert obs.throughput(0.5)["mfu"] == pytest.approx(perf["mfu"] / 2)


@pytest.mark.parametrize("kind, peak", [("TPU v5", 459e12), ("TPU v5 lite", 197e12), ("TPU v6 lite", 918e12),
                                        ("TPU v4", 275e12), ("NVIDIA H100 80GB HBM3", 989e12),
                                        ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                        ("NVIDIA H100 PCIe", 756e12),
                                        ("cpu", None), ("TPU v9", None)])
def test_peak_table(kind, peak):
    assert observe.peak_flops(kind) == peak


def test_profiler_writes_a_trace_for_the_requested_steps(tmp_path):
    obs = RunObserver(str(tmp_path), model_cfg=CFG, tcfg=TCFG, profile_steps=(2, 3), primary=True)
    f = jax.jit(lambda x: x @ x)
    x = jnp.ones((16, 16))
    seen = []
    for step in range(1, 6):
        obs.step_started(step)
        seen.append(obs._tracing)
        f(x).block_until_ready()
    obs.close()
    assert seen == [False, True, True, False, False]
    traces = glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0


def test_non_primary_writes_nothing(tmp_path):
    obs = RunObserver(str(tmp_path / "w"), model_cfg=CFG, tcfg=TCFG, profile_steps=(1, 1), primary=False)
    obs.step_started(1)
    perf = obs.record(1, {"loss": 2.0}, step_seconds=1.0)
    obs.step_started(2)
    obs.close()
    assert perf["tokens_per_s"] == 128.0
    assert not (tmp_path / "w").exists()


def test_progress_line(tmp_path):
    obs = RunObserver(str(tmp_path), model_cfg=CFG, tcfg=TCFG, primary=False, device_kind="TPU v5")
    obs.record(1, {"loss": 3.0}, step_seconds=10.0)      # compile step: out of the ETA
    obs.record(2, {"loss": 2.0}, step_seconds=1.0)
    obs.record(3, {"loss": 1.5}, step_seconds=3.0)
    line = obs.progress(3, 20, {"loss": 1.5}, {"eval_loss": 1.75})
    mfu = estimate(CFG, 32)["train_flops_per_token"] * (128 / (14 / 3)) / 459e12
    # window mean (10+1+3)/3 s; ETA 17 steps x mean 2 s without the compile step
    assert line == f"step 3/20 loss 1.5000 eval_loss 1.7500 4.667 s/step 27 tok/s MFU {mfu:.1%} ETA 0:00:34"
    obs.record(4, {"loss": 1.0}, step_seconds=2.0)
    assert "2.000 s/step 64 tok/s" in obs.progress(4, 20, {"loss": 1.0}, {})


def test_bad_inputs_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="profile_steps"):
        RunObserver(str(tmp_path), model_cfg=CFG, tcfg=TCFG, profile_steps=(3, 2), primary=False)
    obs = RunObserver(str(tmp_path), model_cfg=CFG, tcfg=TCFG, primary=False)
    with pytest.raises(ValueError, match="step_seconds"):
        obs.record(1, {}, step_seconds=0.0)
