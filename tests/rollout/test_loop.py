"""The rollout loop prompts each policy with the world of the env it plays."""

from acting_helpers import agent_for
from hieragent.agents.policy import Executor, Planner
from hieragent.envs import BabyAITextEnv, EnvPool, make_env
from hieragent.rollout.loop import RolloutSettings, collect


def test_each_env_is_prompted_as_its_own_world(tiny_lm, tokenizer) -> None:
    planner, executor = Planner(mode="score"), Executor(mode="score")
    planner.bind(tiny_lm, tokenizer), executor.bind(tiny_lm, tokenizer)
    pool = EnvPool([BabyAITextEnv("BabyAI-GoToRedBallNoDists-v0", max_steps=2),
                    make_env("FrozenLake-4x4-v0", max_steps=2)])
    babyai, lake = collect(pool, [1, 2], [1, 2], agent_for(executor, planner),
                           RolloutSettings(max_subgoal_steps=1), greedy=True)
    for trajectory, world, other in ((babyai, "a grid world", "frozen lake"),
                                     (lake, "a frozen lake grid", "grid world.")):
        for role in ("planner", "executor"):
            turns = trajectory.of(role)
            assert turns, role
            system = tokenizer.decode(turns[0].prompt_ids)
            assert f"agent in {world}." in system and other not in system
