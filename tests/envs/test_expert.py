"""The BabyAI bot as an expert: success per level, and its episodes cut into our subgoals."""

import pytest

from hieragent.envs.babyai import BabyAITextEnv
from hieragent.envs.expert import expert_episode, expert_segments, expert_success_rate

# Levels whose missions cover every verb of the subgoal grammar: go to, pick up, open
# (locked, with the key), put next, and exploration of several rooms.
LEVELS = ["BabyAI-GoToLocal-v0", "BabyAI-PickupLoc-v0", "BabyAI-OpenDoor-v0",
          "BabyAI-UnlockLocal-v0", "BabyAI-PutNextLocal-v0", "BabyAI-GoTo-v0"]


@pytest.mark.parametrize("level", LEVELS)
def test_expert_succeeds_on_at_least_nine_of_ten_seeds(level: str) -> None:
    assert expert_success_rate(level, range(10)) >= 0.9


@pytest.mark.parametrize("level", LEVELS)
def test_segments_replay_the_bots_episode_with_each_subgoal_done_on_its_last_action(level: str) -> None:
    env = BabyAITextEnv(level)
    verified = 0
    for seed in range(6):
        segments = expert_segments(env, seed)
        if not segments:
            continue
        success, length = expert_episode(level, seed)
        assert success and length == sum(len(a) for _, a in segments)  # the bot's own actions
        env.reset(seed)
        for subgoal, actions in segments:
            assert actions
            assert env.set_subgoal(subgoal) == "", subgoal
            done = [env.step(a).subgoal_done for a in actions]
            assert done == [False] * (len(actions) - 1) + [True], (seed, subgoal)
        verified += 1
    assert verified >= 5


def test_put_next_levels_are_cut_into_pick_up_then_put_next() -> None:
    env = BabyAITextEnv("BabyAI-PutNextLocal-v0")
    verbs = [s.split(" the ")[0] for s in (sg for sg, _ in expert_segments(env, 0))]
    assert "pick up" in verbs and verbs[-1] == "put"


def test_unseen_targets_are_preceded_by_explore_segments_offered_to_the_planner() -> None:
    env = BabyAITextEnv("BabyAI-GoTo-v0")
    found = False
    for seed in range(6):
        segments = expert_segments(env, seed)
        obs = env.reset(seed)
        for subgoal, actions in segments:
            if subgoal == "explore":
                found = True
                assert "explore" in obs.subgoals
            env.set_subgoal(subgoal)
            for a in actions:
                obs = env.step(a).observation
    assert found


def test_a_failed_bot_episode_gives_no_segments() -> None:
    env = BabyAITextEnv("BabyAI-GoToLocal-v0", max_steps=1)  # too short for the bot
    assert expert_segments(env, 3) == []
