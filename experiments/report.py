"""Run evidence: report.json, report.md and PNG plots in the run's workdir.

Paths go through etils.epath, so a workdir may be a URL (gs://bucket/run). In a multi-process run only
process 0 writes (every process computes the same report)."""

from __future__ import annotations

import io
import json

import jax
import matplotlib
from etils import epath

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _primary() -> bool:
    return jax.process_index() == 0


def plot_curves(path: str, series: dict[str, tuple[list, list]], *, title: str, xlabel: str = "step",
                ylabel: str = "eval loss", logy: bool = False) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, (xs, ys) in series.items():
        if xs:
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    if _primary():
        buf = io.BytesIO()               # rendered in memory, written through epath (local or gs://)
        fig.savefig(buf, format="png")
        epath.Path(path).write_bytes(buf.getvalue())
    plt.close(fig)
    return path


def write_report(workdir: str, report: dict, markdown: str) -> None:
    if not _primary():
        return
    root = epath.Path(workdir)
    (root / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    (root / "report.md").write_text(markdown.rstrip() + "\n")


def md_table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def eval_series(history: list[dict], key: str = "eval_loss", offset: int = 0) -> tuple[list, list]:
    rows = [r for r in history if key in r]
    return [r["step"] + offset for r in rows], [r[key] for r in rows]
