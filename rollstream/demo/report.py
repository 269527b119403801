"""The end of a demo run: per-step records, the reward plot, the summary table.

The example trainer (a child process, one rank or several) writes one JSON line per step
(``--steps-file``), a :class:`StepRecord`, which the demo reads back; the example imports it
from here (the core never imports the example).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.table import Table

WINDOW = 5
# a worker's own engine (hf), or the sync owner of a shared server (vllm, sglang)
RELOAD_LINE = re.compile(r"(?:now generating with weight version|: now at weight version) (\d+)")


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


@dataclass(frozen=True)
class StepRecord:
    """One finished step, all ranks together (one line of the trainer's steps file, the figures the
    demo shows); ``version`` is the version published after it, ``loss`` rank 0's last epoch,
    ``seconds`` the step's wall time, waiting for its groups included."""

    step: int
    version: int
    reward_mean: float
    episodes: int
    groups: int
    ranks: int
    loss: float
    clip_fraction: float
    approx_kl: float
    grad_norm: float
    staleness_mean: float
    staleness_max: int
    head_version: int
    tail_version: int
    seconds: float
    finished_at: float  # time.time()

    @classmethod
    def from_json(cls, line: str) -> StepRecord:
        fields = json.loads(line)
        return cls(**{name: fields[name] for name in cls.__dataclass_fields__})


class StepsFile:
    """Follows the steps file as the trainer appends to it (whole lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def new_records(self) -> list[StepRecord]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        return [StepRecord.from_json(line) for line in complete.decode().splitlines() if line.strip()]


class StepsLog:
    """The trainer's end of the steps file: one line per committed step, each step once.

    The line is appended after the step's commit. A crash between the two leaves a committed
    step without its line; the restarted trainer writes it from the record it saved with the
    step's checkpoint (see ``examples/grpo_trainer.py``), so :meth:`steps` tells it which."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def steps(self) -> list[int]:
        """The steps that have a line, in file order; a torn last line (a crash inside the
        write) is cut off first, so the next line starts on a line of its own."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) != len(data):
            os.truncate(self.path, len(complete))
        return [json.loads(line)["step"] for line in complete.decode().splitlines() if line.strip()]

    def append(self, record: StepRecord) -> None:
        """Append ``record`` as one line (one write, then fsync)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(asdict(record)) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)


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
    """The versions the rollout workers said they loaded (into their own engine, or into a
    shared server they own), from their logs, in order."""
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
