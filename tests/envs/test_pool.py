"""EnvPool in-process: exactly like the same envs stepped one by one, and failures contained.

Worker processes are tested in test_workers.py."""

from __future__ import annotations

import random

import pytest

from flaky_envs import FlakyEnv

from hieragent.envs import ACTIONS, BabyAITextEnv, EnvPool, make_env
from hieragent.envs.guards import LoopGuard, ended_by_loop
from hieragent.envs.pool import FAILED_FEEDBACK
from hieragent.types import Observation

LOCAL = "BabyAI-GoToLocal-v0"


def test_pool_matches_envs_stepped_individually() -> None:
    seeds = [11, 12, 13, 11]
    pool = EnvPool.make(LOCAL, len(seeds), max_steps=20)
    solo = [make_env(LOCAL, max_steps=20) for _ in seeds]
    assert pool.reset(seeds) == [env.reset(s) for env, s in zip(solo, seeds)]
    rng = random.Random(0)
    live = set(range(len(seeds)))
    while live:
        # A random subset each turn, as rollout does when some envs wait on the planner.
        chosen = sorted(rng.sample(sorted(live), rng.randint(1, len(live))))
        actions = {i: rng.choice(ACTIONS + ["dance"]) for i in chosen}
        subgoals = {i: rng.choice(["explore", "go to the red ball", None]) for i in chosen}
        assert pool.set_subgoals(subgoals) == {i: solo[i].set_subgoal(s) for i, s in subgoals.items()}
        results = pool.step(actions)
        assert results == {i: solo[i].step(a) for i, a in actions.items()}
        live -= {i for i, r in results.items() if r.done}


def test_pool_steps_only_the_named_envs() -> None:
    pool = EnvPool.make(LOCAL, 3)
    pool.reset([0, 1, 2])
    results = pool.step({1: "turn left"})
    assert list(results) == [1]
    assert [env.unwrapped.step_count for env in pool.envs] == [0, 1, 0]


def test_pool_rejects_bad_indices_and_seed_counts() -> None:
    pool = EnvPool([BabyAITextEnv(LOCAL), BabyAITextEnv(LOCAL)])
    assert len(pool) == 2
    with pytest.raises(ValueError, match="3 seeds for 2 envs"):
        pool.reset([0, 1, 2])
    pool.reset([0, 1])
    with pytest.raises(IndexError, match=r"\[2\]"):
        pool.step({2: "turn left"})
    with pytest.raises(ValueError, match="unknown env"):
        EnvPool.make("BabyAI-Nope-v0", 2)


def test_pool_make_passes_env_kwargs() -> None:
    pool = EnvPool.make(LOCAL, 2, max_steps=5, invalid_penalty=0.5)
    pool.reset([0, 1])
    assert [env.max_steps for env in pool.envs] == [5, 5]
    assert pool.invalid_penalty(1) == 0.5
    assert pool.step({0: "x"})[0].reward == -0.5


def test_pool_gives_each_envs_world_through_the_loop_guard() -> None:
    pool = EnvPool([BabyAITextEnv(LOCAL), LoopGuard(make_env("Sokoban-6x6-1box-v0"))])
    assert [pool.world(0), pool.world(1)] == ["a grid world", "a Sokoban puzzle"]


# ---- failures, in-process ------------------------------------------------------------
FAULTS = {101: ("raise", 2), 104: ("raise", "reset"), 105: ("raise", "set_subgoal")}


def flaky_pool(n: int) -> EnvPool:
    return EnvPool.make(LOCAL, n, factory=FlakyEnv, faults=FAULTS, max_steps=30)


def test_an_env_that_raises_is_failed_and_counted_and_the_others_go_on() -> None:
    pool, solo = flaky_pool(3), make_env(LOCAL, max_steps=30)
    observations = pool.reset([104, 105, 7])  # env 0 raises in reset, env 1 in set_subgoal
    assert observations[0] == Observation("", "", [], []) and observations[2] == solo.reset(7)
    assert pool.failed == {0} and pool.dropped_episodes == 1
    feedback = pool.set_subgoals({1: "explore", 2: "explore"})
    assert feedback[1].startswith(FAILED_FEEDBACK) and "injected fault in set_subgoal" in feedback[1]
    assert feedback[2] == solo.set_subgoal("explore") == ""
    assert pool.failed == {0, 1} and pool.dropped_episodes == 2
    results = pool.step({0: "turn left", 1: "turn left", 2: "turn left"})
    assert results[2] == solo.step("turn left")
    for i in (0, 1):  # not called again before a reset, and not counted twice
        assert results[i].done and not results[i].success and results[i].reward == 0.0
        assert results[i].feedback.startswith(FAILED_FEEDBACK)
    assert "injected fault in set_subgoal" in results[1].feedback  # the reason is kept
    assert pool.dropped_episodes == 2

    pool.reset([101, 7, 8])  # env 0 now raises on its second step
    assert pool.failed == set()
    assert not pool.step({0: "turn left"})[0].done
    result = pool.step({0: "turn left", 1: "turn left"})
    assert result[0].done and not result[0].success and result[0].reward == 0.0
    assert result[0].feedback.startswith(
        f"{FAILED_FEEDBACK}step raised RuntimeError: injected fault in 2 (at flaky_envs.py:")
    assert not result[1].done
    assert pool.failed == {0} and pool.dropped_episodes == 3 and pool.restarts == 0


def test_calling_an_env_with_no_episode_in_progress_is_a_failure_not_an_exception() -> None:
    pool = EnvPool.make(LOCAL, 2, max_steps=2)
    assert pool.step({0: "turn left"})[0].feedback.startswith(FAILED_FEEDBACK)  # never reset
    assert pool.failed == {0} and pool.dropped_episodes == 0  # no episode was lost
    pool.reset([0, 1])
    pool.step({0: "turn left"})
    assert pool.step({0: "turn left"})[0].done  # the cap
    assert pool.set_subgoals({0: "explore"})[0].startswith(FAILED_FEEDBACK)
    assert pool.step({0: "turn left"})[0].feedback.startswith(FAILED_FEEDBACK)
    assert pool.failed == {0} and pool.dropped_episodes == 0
    assert not pool.step({1: "turn left"})[1].done


def test_pool_make_applies_the_loop_guard() -> None:
    with EnvPool.make(LOCAL, 2, loop_guard=4, loop_penalty=0.5, max_steps=50) as pool:
        pool.reset([0, 1])
        assert isinstance(pool.envs[0], LoopGuard) and pool.envs[0].max_steps == 50
        for _ in range(3):
            assert not pool.step({0: "dance"})[0].done
        result = pool.step({0: "dance"})[0]
        assert ended_by_loop(result) and result.reward == pytest.approx(-0.6)
        assert pool.envs[0].unwrapped.step_count == 4 and pool.failed == set()
        assert pool.worker_pid(0) is None
