"""The chaos run's fault schedule: drawn from a seed, the same list of faults for the same seed.

The schedule is drawn whole before the run: kinds, targets, times and durations. Targets are
resolved here by playing the fleet's membership forward (which rollout workers run after the
joins and leaves before), so a seed names concrete instances and the run only executes it;
the wall time each fault takes varies with the machine, the list does not. The first faults
are every kind once (in the seed's order), so a short run still meets each one; the rest are
drawn by :data:`WEIGHTS`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KILL = "kill"  # SIGKILL an instance (its process tree), start it again after `seconds`
PAUSE = "pause"  # SIGSTOP an instance (its process tree) for `seconds`, then SIGCONT
NODE_KILL = "node kill"  # SIGKILL a broker node, start it again after `seconds`
NODE_RESTART = "node restart"  # clean stop and start of a broker node
NODE_PAUSE = "node pause"  # SIGSTOP a broker node for `seconds` (a network partition)
REDIS_RESTART = "redis restart"  # SIGKILL, `seconds` down, start from its append-only file (fsync every second)
REDIS_WIPE = "redis restart without persistence"  # stop, `seconds` down, start with nothing
REDIS_RESTORE = "redis restored from an earlier snapshot"  # snapshot, `seconds` of work, SIGKILL, start from it
JOIN = "rollout join"  # a rollout worker with a worker id not running starts
LEAVE = "rollout leave"  # a running rollout worker gets SIGTERM and stays away
RESTART = "rollout restart"  # a running rollout worker gets SIGTERM and starts again, same worker id
# The weight path (a run on a vLLM server): the targets are found when the fault comes.
OWNER_PAUSE = "owner paused mid-load"  # SIGSTOP the server's sync owner in a load, past its lease
SERVER_KILL = "server killed mid-load"  # SIGKILL the vLLM server in a load, start it after `seconds`
OWNER_KILL = "owner killed"  # SIGKILL the rollout worker that owns the server, start it after `seconds`

KINDS = (KILL, PAUSE, NODE_KILL, NODE_RESTART, NODE_PAUSE, REDIS_RESTART, REDIS_WIPE, REDIS_RESTORE, JOIN, LEAVE,
         RESTART)
WEIGHT_KINDS = (OWNER_PAUSE, SERVER_KILL, OWNER_KILL)
ALL_KINDS = KINDS + WEIGHT_KINDS
NODE_KINDS = (NODE_KILL, NODE_RESTART, NODE_PAUSE)
WEIGHTS = {KILL: 24, PAUSE: 20, NODE_KILL: 8, NODE_RESTART: 5, NODE_PAUSE: 8, REDIS_RESTART: 5, REDIS_WIPE: 5,
           REDIS_RESTORE: 5, JOIN: 9, LEAVE: 8, RESTART: 8}
WEIGHT_PATH_WEIGHTS = {OWNER_PAUSE: 8, SERVER_KILL: 4, OWNER_KILL: 6}
OWNER = "the server's owner"  # the target of the owner faults: whoever holds the lease then
SERVER = "vllm"
TRAINER = "trainer"


@dataclass(frozen=True)
class Fleet:
    """Who runs: instances per tier (rollout workers at the start, and at most), broker nodes."""

    producers: int = 2
    rollout: int = 2
    rollout_max: int = 4
    reward: int = 2
    grouping: int = 2
    nodes: int = 3

    def fixed(self) -> list[str]:
        """Instances that always run (a kill or pause brings them back): every tier but the
        rollout fleet, and the trainer."""
        return ([f"producer-{i}" for i in range(self.producers)] + [f"reward-{i}" for i in range(self.reward)]
                + [f"grouping-{i}" for i in range(self.grouping)] + [TRAINER])

    def rollout_ids(self) -> list[str]:
        return [f"rollout-{i}" for i in range(self.rollout_max)]


@dataclass(frozen=True)
class Fault:
    """One fault: ``at`` seconds after the faults begin, ``target`` an instance name, a node
    (``node-2``) or ``redis``; ``seconds`` how long it lasts (down or paused), 0 when instant."""

    at: float
    kind: str
    target: str
    seconds: float = 0.0

    def line(self) -> str:
        lasting = f" for {self.seconds:.1f}s" if self.seconds else ""
        return f"t+{self.at:6.1f}s {self.kind} {self.target}{lasting}"


def _duration(rng: random.Random, kind: str) -> float:
    """How long a fault lasts: pauses from a hiccup to well past every session and failure
    timeout of the run's config (6-10 s)."""
    low, high = {KILL: (0.0, 4.0), PAUSE: (1.0, 20.0), NODE_KILL: (2.0, 10.0), NODE_PAUSE: (3.0, 12.0),
                 REDIS_RESTART: (0.0, 3.0), REDIS_WIPE: (0.0, 3.0),
                 REDIS_RESTORE: (2.0, 8.0),  # restore: how old the snapshot is
                 OWNER_PAUSE: (8.0, 15.0),  # past the run's 5 s lease
                 SERVER_KILL: (0.0, 3.0), OWNER_KILL: (0.0, 4.0)}.get(kind, (0.0, 0.0))
    return round(rng.uniform(low, high), 1) if high else 0.0


class _Membership:
    """The rollout workers that run, played forward through the schedule."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.running = [f"rollout-{i}" for i in range(fleet.rollout)]
        self.used = set(self.running)

    def possible(self, kind: str) -> bool:
        if kind == JOIN:
            return len(self.running) < self.fleet.rollout_max
        if kind == LEAVE:
            return len(self.running) > self.fleet.rollout  # never fewer than the fleet starts with
        return True

    def target(self, rng: random.Random, kind: str) -> str:
        if kind in (KILL, PAUSE):
            return rng.choice(self.fleet.fixed() + sorted(self.running))
        if kind in NODE_KINDS:
            return f"node-{rng.randint(1, self.fleet.nodes)}"
        if kind in (REDIS_RESTART, REDIS_WIPE, REDIS_RESTORE):
            return "redis"
        if kind in (OWNER_PAUSE, OWNER_KILL):
            return OWNER
        if kind == SERVER_KILL:
            return SERVER
        if kind == JOIN:
            idle = [w for w in self.fleet.rollout_ids() if w not in self.running]
            fresh = [w for w in idle if w not in self.used]  # a new worker id first, else one that left
            worker = rng.choice(fresh or idle)
            self.running.append(worker)
            self.used.add(worker)
            return worker
        worker = rng.choice(sorted(self.running))
        if kind == LEAVE:
            self.running.remove(worker)
        return worker


def draw_schedule(seed: int, seconds: float, fleet: Fleet = Fleet(), mean_gap: float = 22.0,
                  weight_path: bool = False) -> list[Fault]:
    """The faults of a run of ``seconds``, one every ``mean_gap`` seconds on average (each gap
    drawn between half and one and a half of it); the same list for the same arguments. With
    ``weight_path`` (a run on a vLLM server) the weight path's kinds are drawn too."""
    rng = random.Random(seed)
    weights = WEIGHTS | (WEIGHT_PATH_WEIGHTS if weight_path else {})
    deck = list(ALL_KINDS if weight_path else KINDS)
    rng.shuffle(deck)
    members = _Membership(fleet)
    faults: list[Fault] = []
    at = rng.uniform(0.2, 0.6) * mean_gap
    while round(at, 1) < seconds:  # as the fault will say it (a time that rounds up to the end is past it)
        kind = _next_kind(rng, deck, members, weights)
        faults.append(Fault(round(at, 1), kind, members.target(rng, kind), _duration(rng, kind)))
        at += rng.uniform(0.5, 1.5) * mean_gap
    return faults


def _next_kind(rng: random.Random, deck: list[str], members: _Membership, weights: dict[str, int]) -> str:
    """The first kind of the deck that is possible now (a leave waits for a join), else a draw."""
    for i, kind in enumerate(deck):
        if members.possible(kind):
            return deck.pop(i)
    while not members.possible(kind := rng.choices(list(weights), weights=list(weights.values()))[0]):
        pass
    return kind
