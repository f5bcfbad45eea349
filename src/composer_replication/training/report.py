"""Run report: PNG plots of a run's metrics and a short markdown summary.

Reads ``metrics.jsonl`` (one row per step; evaluation rows carry ``heldout/pass@1``) and
writes ``report/`` next to it: ``rewards.png`` (in-loop reward and held-out pass@1),
``kl.png`` (KL to the initial policy and to the sampler), ``losses.png`` (per-component
losses) and ``summary.md``; a run with agent episodes also gets ``agent.png`` (turns and
tool calls per episode, parse failure rate) and ``agent_ends.png`` (how the episodes
ended), each for training and held-out episodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from composer_replication.common.metrics import read_rows

_LOSS_KEYS = ("loss/rl", "loss/ce", "loss/ref_kl", "loss/jsd", "loss/dpo")


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pairs = [(int(r["step"]), float(r[key])) for r in rows if r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


#: The report's plots: file name, y label, (metric, legend label) per curve.
PANELS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    (
        "rewards.png",
        "reward",
        (("reward/mean", "in-loop reward"), ("heldout/pass@1", "held-out pass@1")),
    ),
    (
        "kl.png",
        "nats/token",
        (("kl/to_init", "KL to initial policy"), ("kl/inference", "KL sampler||trainer")),
    ),
    ("losses.png", "component mean", tuple((k, k.split("/")[1]) for k in _LOSS_KEYS)),
)
#: Plots of agent episodes, written only when a run has them.
AGENT_PANELS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    (
        "agent.png",
        "per episode / rate",
        (
            ("agent/turns_mean", "turns"),
            ("agent/tool_calls_mean", "tool calls"),
            ("agent/parse_failure_rate", "parse failure rate"),
            ("heldout/agent/turns_mean", "held-out turns"),
            ("heldout/agent/tool_calls_mean", "held-out tool calls"),
            ("heldout/agent/parse_failure_rate", "held-out parse failure rate"),
        ),
    ),
    (
        "agent_ends.png",
        "share of episodes",
        tuple(
            (f"{prefix}agent/end/{reason}", f"{where}{reason}")
            for prefix, where in (("", ""), ("heldout/", "held-out "))
            for reason in ("finish", "answer", "truncated", "turn_limit", "token_limit")
        ),
    ),
)


def plotted_series(rows: list[dict[str, Any]], keys: Any) -> list[str]:
    """The metrics of ``keys`` ((metric, label) pairs) that a plot of ``rows`` draws: those
    with at least one non-zero value."""
    drawn = []
    for key, _ in keys:
        xs, ys = _series(rows, key)
        if xs and any(y != 0 for y in ys):
            drawn.append(key)
    return drawn


def write_report(run_dir: str | Path) -> Path:
    """Plot the run's metrics into ``<run_dir>/report`` and return that directory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_rows(run_dir / "metrics.jsonl")
    if not rows:
        raise FileNotFoundError(f"no metrics rows in {run_dir / 'metrics.jsonl'}")
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)

    agent = [panel for panel in AGENT_PANELS if plotted_series(rows, panel[2])]
    for filename, ylabel, keys in (*PANELS, *agent):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        drawn = plotted_series(rows, keys)
        for key, label in keys:
            if key in drawn:
                xs, ys = _series(rows, key)
                ax.plot(xs, ys, marker="o", markersize=3, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)

    (out / "summary.md").write_text(summary_markdown(rows))
    return out


def summary_markdown(rows: list[dict[str, Any]]) -> str:
    """A short table: first/last/best of the headline metrics, and how the run ended."""
    lines = ["# Run summary", "", "| metric | first | last | best |", "|---|---|---|---|"]
    for key, better in (
        ("reward/mean", max),
        ("heldout/pass@1", max),
        ("heldout/agent/parse_failure_rate", min),
        ("kl/to_init", min),
        ("loss", min),
    ):
        _, ys = _series(rows, key)
        if ys:
            lines.append(f"| {key} | {ys[0]:.4f} | {ys[-1]:.4f} | {better(ys):.4f} |")
    last = rows[-1]
    lines += ["", f"steps: {max(int(r['step']) for r in rows)}"]
    stops = [r for r in rows if r.get("guard/fired")]
    if stops:
        lines.append(f"stopped by the kill switch: {stops[0].get('guard/reason', '')}")
    if "time/total_s" in last:
        lines.append(f"wall time: {last['time/total_s']:.1f} s")
    return "\n".join(lines) + "\n"
