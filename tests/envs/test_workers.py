"""EnvPool with worker processes: the same episodes as in-process, and failures contained.

Workers are real spawned processes; the crash tests really kill, hang or crash them.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import os
import random
import signal
import time
from collections.abc import Callable, Iterator

import pytest
from flaky_envs import FlakyEnv

from hieragent.envs import ACTIONS, BabyAITextEnv, EnvPool, make_env
from hieragent.envs.guards import ended_by_loop
from hieragent.envs.pool import FAILED_FEEDBACK
from hieragent.types import Observation

LOCAL = "BabyAI-GoToLocal-v0"
SEEDS = [3, 4, 5, 6]
SUBGOALS = ["explore", "go to the red ball", None]
KWARGS = dict(max_steps=24, invalid_penalty=0.25, loop_guard=8)
# Flaky pool: envs 0, 1 on one worker and 2, 3 on the other.
FAULTS = {101: ("raise", 2), 102: ("hang", 2), 103: ("die", 2), 104: ("raise", "reset")}
TIMEOUT = 2.0


def child_pids() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


def pids_of(pool: EnvPool) -> set[int]:
    return {pool.worker_pid(i) for i in range(len(pool))}


def actions(i: int, seed: int) -> Iterator[str]:
    """Env 0 spins (the loop guard must end it); the others act at random, garbage included."""
    if i == 0:
        return itertools.repeat("turn left")
    rng = random.Random(seed)
    return (rng.choice(ACTIONS + ["dance"]) for _ in itertools.count())


def play(pool: EnvPool, seeds: list[int], before_turn: Callable[[int], None] = lambda t: None) -> list:
    """A scripted episode per env, to the end; every answer of the pool, as (call, answers)."""
    transcript: list = [("reset", dict(enumerate(pool.reset(seeds))))]
    streams = [actions(i, s) for i, s in enumerate(seeds)]
    live = set(range(len(seeds)))
    for turn in itertools.count():
        if not live:
            return transcript
        before_turn(turn)
        if turn % 3 == 0:
            subgoals = {i: SUBGOALS[(turn + i) % 3] for i in sorted(live)}
            transcript.append(("set_subgoals", pool.set_subgoals(subgoals)))
        results = pool.step({i: next(streams[i]) for i in sorted(live)})
        transcript.append(("step", results))
        live -= {i for i, r in results.items() if r.done}


def of_env(transcript: list, i: int) -> list:
    return [(call, answers[i]) for call, answers in transcript if i in answers]


def kill(pid: int) -> None:
    """SIGKILL a worker and wait until it is dead (joined by multiprocessing, not reaped by us).

    The worker is looked up before the kill: `active_children()` drops children that have
    already exited, so a lookup after the signal can miss one that died quickly.
    """
    [worker] = [p for p in multiprocessing.active_children() if p.pid == pid]
    os.kill(pid, signal.SIGKILL)
    worker.join(10)
    assert worker.exitcode == -signal.SIGKILL


@pytest.fixture(scope="module")
def reference() -> list:
    return play(EnvPool.make(LOCAL, len(SEEDS), **KWARGS), SEEDS)


@pytest.fixture(scope="module")
def pool() -> Iterator[EnvPool]:
    with EnvPool.make(LOCAL, len(SEEDS), workers=2, **KWARGS) as pool:
        yield pool
    assert not pids_of(pool) & child_pids()


@pytest.fixture(scope="module")
def flaky() -> Iterator[EnvPool]:
    with EnvPool.make(LOCAL, 4, workers=2, step_timeout=TIMEOUT, factory=FlakyEnv,
                      faults=FAULTS, max_steps=24) as pool:
        yield pool
    assert not pids_of(pool) & child_pids()


def test_workers_play_the_same_episodes_as_in_process(pool: EnvPool, reference: list) -> None:
    assert len({pool.worker_pid(i) for i in range(4)}) == 2
    assert play(pool, SEEDS) == reference
    assert ended_by_loop(of_env(reference, 0)[-1][1])  # the guard runs in the workers too
    assert pool.failed == set() and pool.dropped_episodes == 0 and pool.restarts == 0
    assert pool.invalid_penalty(3) == 0.25
    assert pool.world(3) == BabyAITextEnv.world  # read in the worker, through the loop guard
    with pytest.raises(AttributeError, match="worker processes"):
        pool.envs


def test_a_killed_worker_fails_its_envs_and_is_restarted_and_the_others_go_on(
        pool: EnvPool, reference: list) -> None:
    dropped, restarts, dead = pool.dropped_episodes, pool.restarts, pool.worker_pid(0)
    # Killed after turn 10: env 0 (same worker) ended at step 8, env 1 is mid-episode.
    transcript = play(pool, SEEDS, lambda turn: kill(dead) if turn == 10 else None)
    for i in (0, 2, 3):  # finished before the kill, or on the other worker: unaffected
        assert of_env(transcript, i) == of_env(reference, i)
    ours, theirs = of_env(transcript, 1), of_env(reference, 1)
    assert ours[:-1] == theirs[:len(ours) - 1] and len(ours) < len(theirs)  # the same up to the kill
    call, answer = ours[-1]
    assert call == "step" and answer.done and not answer.success and answer.reward == 0.0
    assert answer.feedback.startswith(f"{FAILED_FEEDBACK}worker {dead} died (exit code -9)")
    assert pool.failed == {1}
    assert pool.dropped_episodes == dropped + 1 and pool.restarts == restarts + 1
    assert pool.worker_pid(0) not in (None, dead) and dead not in child_pids()

    started = time.monotonic()  # a restarted env, stepped before its reset: failed at once
    assert pool.step({0: "turn left"})[0].feedback.startswith(FAILED_FEEDBACK)
    assert time.monotonic() - started < 1.0 and pool.dropped_episodes == dropped + 1
    assert play(pool, SEEDS) == reference  # the rebuilt worker replays the seeds exactly
    assert pool.failed == set()


def test_an_env_that_raises_fails_alone_and_its_worker_lives(flaky: EnvPool) -> None:
    dropped, restarts, pid = flaky.dropped_episodes, flaky.restarts, flaky.worker_pid(0)
    solo = make_env(LOCAL, max_steps=24)
    flaky.reset([101, 7, 8, 9])
    solo.reset(7)
    flaky.step({0: "turn left", 1: "turn left"}), solo.step("turn left")
    results = flaky.step({0: "turn left", 1: "turn left"})
    assert results[0].done and "step raised RuntimeError: injected fault in 2" in results[0].feedback
    assert results[1] == solo.step("turn left")  # same worker, not disturbed
    assert flaky.failed == {0} and flaky.dropped_episodes == dropped + 1
    assert flaky.restarts == restarts and flaky.worker_pid(0) == pid
    assert flaky.step({0: "turn left"})[0].feedback.startswith(FAILED_FEEDBACK)
    assert flaky.dropped_episodes == dropped + 1


def test_a_hanging_worker_times_out_and_is_restarted(flaky: EnvPool) -> None:
    dropped, restarts, hung = flaky.dropped_episodes, flaky.restarts, flaky.worker_pid(2)
    solo = make_env(LOCAL, max_steps=24)
    flaky.reset([7, 8, 102, 9])  # env 2 hangs on its second step
    solo.reset(7)
    flaky.step({i: "turn left" for i in range(4)}), solo.step("turn left")
    started = time.monotonic()
    results = flaky.step({i: "turn left" for i in range(4)})
    assert TIMEOUT <= time.monotonic() - started < TIMEOUT + 5
    assert results[0] == solo.step("turn left") and not results[1].done
    for i in (2, 3):  # env 3 shared the hung worker
        assert results[i].done and f"did not answer step within {TIMEOUT:g} s" in results[i].feedback
    assert flaky.failed == {2, 3} and flaky.dropped_episodes == dropped + 2
    assert flaky.restarts == restarts + 1 and hung not in child_pids()
    observations = flaky.reset([7, 8, 9, 10])  # waits for the new worker to be up
    assert observations[2] == solo.reset(9) and flaky.failed == set()
    assert flaky.step({2: "go forward"})[2] == solo.step("go forward")


def test_a_worker_that_crashes_during_a_call_is_restarted(flaky: EnvPool) -> None:
    dropped, restarts = flaky.dropped_episodes, flaky.restarts
    flaky.reset([103, 7, 8, 9])  # env 0 kills its own process on its second step
    flaky.step({0: "turn left"})
    results = flaky.step({0: "turn left", 2: "turn left"})
    assert "died (exit code -9)" in results[0].feedback and not results[2].done
    assert flaky.failed == {0, 1}  # env 1 was idle but live on the same worker
    assert flaky.dropped_episodes == dropped + 2 and flaky.restarts == restarts + 1


def test_a_reset_that_raises_fails_that_env_only(flaky: EnvPool) -> None:
    observations = flaky.reset([104, 7, 8, 9])
    assert observations[0] == Observation("", "", [], []) and observations[1].mission
    assert flaky.failed == {0}
    results = flaky.step({0: "turn left", 1: "turn left"})
    assert results[0].done and not results[1].done


def test_close_stops_every_worker_and_so_does_garbage_collection() -> None:
    with EnvPool.make(LOCAL, 2, workers=2) as pool:
        pids = pids_of(pool)
        assert len(pids) == 2 and pids <= child_pids()
    assert not pids & child_pids()
    pool.close()  # idempotent
    pool = EnvPool.make(LOCAL, 1, workers=1)
    pids = pids_of(pool)
    del pool
    gc.collect()
    assert not pids & child_pids()


def test_workers_that_cannot_build_their_envs_fail_at_make() -> None:
    before = child_pids()
    with pytest.raises(RuntimeError, match="could not build its envs.*unknown env 'BabyAI-Nope-v0'"):
        EnvPool.make("BabyAI-Nope-v0", 2, workers=1, factory=FlakyEnv)
    with pytest.raises(ValueError, match="cannot be pickled"):
        EnvPool.make(LOCAL, 2, workers=1, factory=lambda name, **kwargs: make_env(name))
    assert child_pids() <= before
