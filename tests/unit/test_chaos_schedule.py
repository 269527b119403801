"""The chaos schedule is the seed's: the same faults for the same seed, every kind early, and
targets that exist when the fault strikes (bench/chaos/schedule.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.chaos import schedule as s


def test_the_same_seed_draws_the_same_schedule_and_another_seed_another() -> None:
    assert s.draw_schedule(7, 1800) == s.draw_schedule(7, 1800)
    assert s.draw_schedule(7, 1800) != s.draw_schedule(8, 1800)


@pytest.mark.parametrize("seed", range(20))
def test_a_short_run_meets_every_kind_and_a_long_one_has_enough(seed: int) -> None:
    short = s.draw_schedule(seed, 150, mean_gap=10)
    assert set(s.KINDS) <= {f.kind for f in short[: len(s.KINDS) + 2]}
    long = s.draw_schedule(seed, 1800)
    assert 60 <= len(long) <= 110 and all(0 < f.at < 1800 for f in long)
    assert [f.at for f in long] == sorted(f.at for f in long)


@pytest.mark.parametrize("seed", range(20))
def test_targets_follow_the_fleet_as_it_changes(seed: int) -> None:
    fleet = s.Fleet()
    running = {f"rollout-{i}" for i in range(fleet.rollout)}
    for fault in s.draw_schedule(seed, 3600, fleet):
        if fault.kind in (s.KILL, s.PAUSE):
            assert fault.target in running | set(fleet.fixed())
        elif fault.kind in (s.RESTART, s.LEAVE):
            assert fault.target in running
        elif fault.kind == s.JOIN:
            assert fault.target not in running
        elif fault.kind in s.NODE_KINDS:
            assert fault.target in {f"node-{n}" for n in range(1, fleet.nodes + 1)}
        running = running - {fault.target} if fault.kind == s.LEAVE else running
        running = running | {fault.target} if fault.kind == s.JOIN else running
        assert fleet.rollout <= len(running) <= fleet.rollout_max


def test_pauses_reach_past_the_runs_timeouts_and_instant_faults_last_nothing() -> None:
    faults = [f for seed in range(10) for f in s.draw_schedule(seed, 3600)]
    pauses = [f.seconds for f in faults if f.kind == s.PAUSE]
    assert min(pauses) < 6 < 10 < max(pauses) <= 20  # some under the session timeouts, some past them
    assert all(f.seconds == 0 for f in faults if f.kind in (s.JOIN, s.LEAVE, s.RESTART, s.NODE_RESTART))
    kinds = Counter(f.kind for f in faults)
    assert kinds[s.KILL] > kinds[s.REDIS_WIPE] > 0 and "trainer" in {f.target for f in faults if f.kind == s.KILL}


@pytest.mark.parametrize("seed", range(10))
def test_a_run_on_a_vllm_server_meets_the_weight_path_faults_early(seed: int) -> None:
    short = s.draw_schedule(seed, 200, mean_gap=10, weight_path=True)
    assert set(s.ALL_KINDS) <= {f.kind for f in short[: len(s.ALL_KINDS) + 2]}
    owners = [f for f in s.draw_schedule(seed, 3600, weight_path=True) if f.kind in s.WEIGHT_KINDS]
    assert all(f.target == (s.SERVER if f.kind == s.SERVER_KILL else s.OWNER) for f in owners)
    assert all(f.seconds > 5.0 for f in owners if f.kind == s.OWNER_PAUSE)  # past the run's lease
    assert not {f.kind for f in s.draw_schedule(seed, 3600)} & set(s.WEIGHT_KINDS)  # only when asked
