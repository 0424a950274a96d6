"""The rollout loop survives env failures: the failed episode is dropped, the rest play on."""

import pytest

from envs.flaky_envs import FlakyEnv  # tests/ is on the path (pyproject)
from acting_helpers import agent_for
from hieragent.agents.policy import Executor
from hieragent.envs.pool import EnvPool
from hieragent.rollout.loop import RolloutSettings, collect

LEVEL = "BabyAI-GoToRedBallNoDists-v0"


@pytest.fixture()
def executor(tiny_lm, tokenizer):
    policy = Executor(mode="score")
    policy.bind(tiny_lm, tokenizer)
    return policy


def play(pool, executor, seeds):
    return collect(pool, seeds, seeds, agent_for(executor), RolloutSettings(hierarchical=False),
                   greedy=True)


@pytest.mark.parametrize("when", ["reset", 2])
def test_an_env_that_raises_loses_only_its_episode(executor, when) -> None:
    seeds = [10, 11, 12]
    clean = play(EnvPool.make(LEVEL, 3, factory=FlakyEnv, max_steps=6), executor, seeds)
    pool = EnvPool.make(LEVEL, 3, factory=FlakyEnv, faults={11: ("raise", when)}, max_steps=6)
    survived = play(pool, executor, seeds)
    assert [t.seed for t in survived] == [10, 12]
    assert pool.dropped_episodes == 1 and pool.failed == {1}
    # the other episodes are exactly what they would have been without the failure
    for got, want in zip(survived, [clean[0], clean[2]]):
        assert [t.text for t in got.turns] == [t.text for t in want.turns]
        assert got.env_return == want.env_return and got.length == want.length
    # the next episode on the same pool plays normally
    again = play(pool, executor, [20, 21, 22])
    assert len(again) == 3 and pool.dropped_episodes == 1


class NoSubgoals(FlakyEnv):
    """A BabyAI level whose planner is offered nothing, as in a TextWorld room with no
    subgoal yet."""

    def reset(self, seed):
        obs = super().reset(seed)
        obs.subgoals = []
        return obs

    def step(self, action):
        result = super().step(action)
        result.observation.subgoals = []
        return result


def test_a_planner_with_no_candidates_hands_the_mission_to_the_executor(tiny_lm, tokenizer) -> None:
    from hieragent.agents.policy import Planner

    planner, executor = Planner(mode="score"), Executor(mode="score")
    planner.bind(tiny_lm, tokenizer), executor.bind(tiny_lm, tokenizer)
    pool = EnvPool([NoSubgoals(LEVEL, max_steps=5), FlakyEnv(LEVEL, max_steps=5)])
    trajectories = collect(pool, [1, 2], [1, 2], agent_for(executor, planner),
                           RolloutSettings(max_subgoal_steps=2), greedy=True)
    bare, planned = trajectories
    assert not bare.of("planner") and bare.length >= 1  # played on without a planner turn
    assert planned.of("planner")
