"""EnvPool must behave exactly like the same envs stepped one by one."""

from __future__ import annotations

import random

import pytest

from hieragent.envs import ACTIONS, BabyAITextEnv, EnvPool, make_env

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
    assert pool.step({0: "x"})[0].reward == -0.5
