"""The one table of accelerator specs (issue 60: four tables disagreed, 95e9 vs 95 * 2**30 bytes).

Units, for every entry:
  hbm_bytes            bytes of device memory per chip, binary (95 GiB = 95 * 2**30: what XLA's memory
                       analysis and its "exceeds available HBM" messages count in)
  peak_flops           dense bfloat16 FLOP/s per chip (the vendor's published peak; no sparsity)
  hbm_bytes_per_s      device-memory bandwidth, bytes/s per chip (None: not listed)
  ici_bytes_per_s      inter-chip interconnect bandwidth, bytes/s per chip (None: not listed)
  host_bounds          chips per host along the topology's axes (TPU hosts; None for GPUs)
  device_kinds         jax's `device.device_kind` strings of this chip: TPU kinds are matched exactly
                       (jax names v5p "TPU v5" and v5e "TPU v5 lite", so a substring would confuse them),
                       GPU kinds ("NVIDIA H100 80GB HBM3") by substring, in table order (the more specific
                       name first)

Vocabulary layer: imports nothing of the project. Readers: glm5_jax.parallel.plan (memory targets),
glm5_jax.train.observe (MFU), tools.aot (HBM per chip, host bounds), tools.budget (roofline peaks).
"""

from __future__ import annotations

import dataclasses

GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: int
    peak_flops: float
    hbm_bytes_per_s: float | None = None
    ici_bytes_per_s: float | None = None
    host_bounds: tuple[int, int, int] | None = None
    device_kinds: tuple[str, ...] = ()
    tpu: bool = True

    @property
    def label(self) -> str:
        """'TPU v5p (95 GiB)', 'H200 (140 GiB)': a memory target's name in tools.plan's report."""
        return f"{'TPU ' if self.tpu else ''}{self.name} ({self.hbm_bytes / GiB:.0f} GiB)"


CHIPS: dict[str, Chip] = {c.name: c for c in (
    # TPUs: Google Cloud's published figures (docs/scaleout.md "Compiled step budget"); ICI one direction:
    #   v5p: 459 TFLOP/s bf16, HBM2e 2765 GB/s, ICI 4800 Gbps = 600 GB/s (1200 GB/s bidirectional)
    #        https://cloud.google.com/tpu/docs/v5p-training, https://docs.cloud.google.com/tpu/docs/v5p
    #   v5e: 197 TFLOP/s, 819 GB/s, ICI 1600 Gbps = 200 GB/s (400 GB/s bidirectional)  https://cloud.google.com/tpu/docs/v5e
    #   v6e: 918 TFLOP/s, 1638 GB/s, ICI 800 GB/s bidirectional = 400 GB/s  https://docs.cloud.google.com/tpu/docs/v6e
    #   v4:  275 TFLOP/s, 1200 GB/s; the page gives no per-chip ICI figure: None (the ICI term is left out)
    #        https://cloud.google.com/tpu/docs/v4
    Chip("v5p", 95 * GiB, 459e12, 2765e9, 4800e9 / 8, (2, 2, 1), ("TPU v5", "TPU v5p")),
    Chip("v4", 32 * GiB, 275e12, 1200e9, None, (2, 2, 1), ("TPU v4",)),
    Chip("v6e", 32 * GiB, 918e12, 1638e9, 400e9, (2, 4, 1), ("TPU v6 lite", "TPU v6e")),
    Chip("v5e", 16 * GiB, 197e12, 819e9, 1600e9 / 8, (2, 4, 1), ("TPU v5 lite", "TPU v5e")),
    # GPUs: NVIDIA's "141 GB" / "80 GB" are nvidia-smi's 143771 / 81559 MiB; SXM peaks unless named PCIe
    Chip("H100 PCIe", 81559 * 2**20, 756e12, None, None, None, ("H100 PCIe",), tpu=False),
    Chip("H200", 143771 * 2**20, 989e12, None, None, None, ("H200",), tpu=False),
    Chip("H100", 81559 * 2**20, 989e12, None, None, None, ("H100",), tpu=False),
    Chip("A100", 81920 * 2**20, 312e12, None, None, None, ("A100",), tpu=False),
)}

TPU_CHIPS: dict[str, Chip] = {k: c for k, c in CHIPS.items() if c.tpu}


def chip_for_device_kind(device_kind: str) -> Chip | None:
    """The chip whose jax device_kind this is (TPU kinds exactly, GPU kinds by substring), else None ("cpu")."""
    for c in CHIPS.values():
        if c.tpu and device_kind in c.device_kinds:
            return c
    for c in CHIPS.values():
        if not c.tpu and any(k in device_kind for k in c.device_kinds):
            return c
    return None


__all__ = ["CHIPS", "Chip", "GiB", "TPU_CHIPS", "chip_for_device_kind"]
