"""Run evidence: report.json, report.md and PNG plots in the run's workdir."""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


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
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(workdir: str, report: dict, markdown: str) -> None:
    with open(os.path.join(workdir, "report.json"), "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write(markdown.rstrip() + "\n")


def md_table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def eval_series(history: list[dict], key: str = "eval_loss", offset: int = 0) -> tuple[list, list]:
    rows = [r for r in history if key in r]
    return [r["step"] + offset for r in rows], [r[key] for r in rows]
