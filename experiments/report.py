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
import matplotlib.pyplot as plt


def _primary() -> bool:
    return jax.process_index() == 0


def plot_curves(path: str, series: dict[str, tuple[list, list]], *, title: str, xlabel: str = "step",
                ylabel: str = "eval loss", logy: bool = False, logx: bool = False,
                bands: dict[str, tuple[list, list]] | None = None, hline: float | None = None) -> str:
    """One line per series; bands[label] = (lo, hi) shades an interval around that series' points;
    hline draws a reference level (e.g. 0 for a difference)."""
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, (xs, ys) in series.items():
        if xs:
            line, = ax.plot(xs, ys, marker="o", markersize=3, label=label)
            if bands and label in bands:
                lo, hi = bands[label]
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2)
    if hline is not None:
        ax.axhline(hline, color="gray", linewidth=0.8)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    if logx:
        ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    if _primary():
        buf = io.BytesIO()               # rendered in memory, written through epath (local or gs://)
        fig.savefig(buf, format="png")
        epath.Path(path).write_bytes(buf.getvalue())
    plt.close(fig)
    return path


def plot_heatmap(path: str, grids: dict[str, list[list]], *, rows: list[str], cols: list[str], title: str,
                 xlabel: str, ylabel: str, vmin: float = 0.0, vmax: float = 1.0) -> str:
    """One annotated heatmap panel per named grid ([len(rows)][len(cols)] values in [vmin, vmax])."""
    n = len(grids)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n + 1, 3.4), dpi=110, squeeze=False)
    for ax, (name, grid) in zip(axes[0], grids.items()):
        im = ax.imshow(grid, vmin=vmin, vmax=vmax, cmap="viridis", aspect="auto", origin="lower")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if v < (vmin + vmax) / 2 else "black")
        ax.set_xticks(range(len(cols)), cols, fontsize=7)
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel)
    axes[0][0].set_ylabel(ylabel)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    fig.suptitle(title, fontsize=10)
    if _primary():
        buf = io.BytesIO()
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


def chain_series(phases: list[tuple[list[dict], int]], key: str = "eval_loss", start: int = 0) -> tuple[list, list]:
    """Phases run one after another, [(history, steps)] -> (xs, ys): phase i's rows at start + the
    steps of the phases before it + their own step."""
    xs, ys, offset = [], [], start
    for history, steps in phases:
        x, y = eval_series(history, key, offset)
        xs += x
        ys += y
        offset += steps
    return xs, ys
