"""The end of a demo run: per-step records, the reward plot, the summary table.

Everything here reads the trainer's ``StepReport`` objects (duck-typed, so the core does
not import the example trainer) and writes into the run directory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

WINDOW = 5
RELOAD_LINE = re.compile(r"now generating with weight version (\d+)")


@dataclass(frozen=True)
class RewardTrend:
    """Mean reward of the first and the last ``window`` steps (NaN when there were none)."""

    first: float
    last: float
    window: int = WINDOW

    def line(self) -> str:
        return f"reward mean first {self.window} steps: {self.first:.3f} / last {self.window} steps: {self.last:.3f}"


def reward_trend(rewards: Sequence[float], window: int = WINDOW) -> RewardTrend:
    if not rewards:
        return RewardTrend(float("nan"), float("nan"), window)
    head, tail = rewards[:window], rewards[-window:]
    return RewardTrend(sum(head) / len(head), sum(tail) / len(tail), window)


def step_record(report: Any) -> dict[str, Any]:
    """One JSON-able line per trainer step (``steps.jsonl``)."""
    return {
        "step": report.step, "version": report.version, "reward_mean": report.reward_mean,
        "episodes": report.episodes, "groups": report.groups, "seconds": round(report.seconds, 3),
        "loss": report.update.loss.loss, "clip_fraction": report.update.loss.clip_fraction,
        "approx_kl": report.update.loss.approx_kl, "grad_norm": report.update.grad_norm,
        "staleness_mean": report.staleness.mean, "staleness_max": report.staleness.max,
        "head_version": report.head_version, "tail_version": report.tail_version,
    }


def write_steps(path: Path, reports: Sequence[Any]) -> Path:
    path.write_text("".join(json.dumps(step_record(r)) + "\n" for r in reports))
    return path


def plot_rewards(path: Path, rewards: Sequence[float], title: str, window: int = WINDOW) -> Path:
    """A PNG of the reward per step with its moving average (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(rewards) + 1))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, rewards, marker="o", markersize=3, linewidth=1, label="reward mean per step")
    if len(rewards) >= window:
        smooth = [sum(rewards[i - window + 1:i + 1]) / window for i in range(window - 1, len(rewards))]
        ax.plot(steps[window - 1:], smooth, linewidth=2, label=f"moving average ({window} steps)")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def weight_reloads(log_paths: Sequence[Path]) -> list[int]:
    """The versions the rollout workers said they loaded, from their logs, in order."""
    versions: list[int] = []
    for path in log_paths:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        versions += [int(v) for v in RELOAD_LINE.findall(text)]
    return versions


def summary_table(rows: Sequence[tuple[str, str]], title: str = "rollstream demo summary") -> Table:
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")  # paths wrap instead of being cut
    for name, value in rows:
        table.add_row(name, value)
    return table
