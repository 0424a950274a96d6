"""LoopGuard on real BabyAI episodes: when it ends an episode, how, and when it keeps out."""

from __future__ import annotations

import pytest
from minigrid.utils.baby_ai_bot import BabyAIBot

from hieragent.envs import BabyAITextEnv
from hieragent.envs.expert import expert_action
from hieragent.envs.guards import LoopGuard, ended_by_loop

LOCAL = "BabyAI-GoToLocal-v0"


def guarded(repeats: int, max_period: int = 4, penalty: float = 0.5, max_steps: int = 100) -> LoopGuard:
    env = LoopGuard(BabyAITextEnv(LOCAL, max_steps=max_steps), repeats, max_period, penalty)
    env.reset(1)
    return env


def test_an_action_that_changes_nothing_ends_the_episode_at_exactly_repeats() -> None:
    env = guarded(repeats=5, penalty=0.5)
    for _ in range(4):
        result = env.step("dance")
        assert not result.done and not ended_by_loop(result)
    result = env.step("Dance.")  # matched after normalize
    assert result.done and not result.success and result.invalid
    assert result.reward == pytest.approx(-0.1 - 0.5)  # its own invalid penalty, then the guard's
    assert result.feedback == "episode ended: repeated 'dance' 5 times"
    assert ended_by_loop(result)


def test_a_different_action_breaks_the_window() -> None:
    env = guarded(repeats=5)
    for action in ["dance"] * 4 + ["turn left"] + ["dance"] * 4:
        assert not env.step(action).done
    assert ended_by_loop(env.step("dance"))  # five dances in a row now


def test_turn_left_turn_right_is_a_period_two_loop() -> None:
    env = guarded(repeats=6)
    for action in ["turn left", "turn right"] * 2 + ["turn left"]:
        assert not env.step(action).done
    result = env.step("turn right")
    assert result.done and ended_by_loop(result)
    assert result.reward == pytest.approx(-0.5)
    assert result.feedback == "episode ended: repeated the cycle 'turn left', 'turn right' for 6 steps"


def test_spinning_is_a_period_four_loop_seen_only_up_to_max_period() -> None:
    env = guarded(repeats=8, max_period=4)
    for _ in range(7):
        assert not env.step("turn left").done
    result = env.step("turn left")
    assert ended_by_loop(result) and result.feedback == "episode ended: repeated 'turn left' 8 times"
    short = guarded(repeats=8, max_period=2)
    assert not any(short.step("turn left").done for _ in range(12))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_expert_is_never_stopped_and_sees_the_same_episode(seed: int) -> None:
    env, plain = LoopGuard(BabyAITextEnv(LOCAL), repeats=4), BabyAITextEnv(LOCAL)
    assert env.reset(seed) == plain.reset(seed)
    bot = BabyAIBot(env.unwrapped)  # read through the guard
    while True:
        action = expert_action(bot)
        result = env.step(action)
        assert result == plain.step(action)
        if result.done:
            break
    assert result.success


def test_an_episode_that_ends_by_itself_is_passed_through() -> None:
    env = guarded(repeats=3, max_steps=3)
    env.step("dance"), env.step("dance")
    result = env.step("dance")  # the cap and a full window on the same step: the cap wins
    assert result.done and not ended_by_loop(result)
    assert result.reward == pytest.approx(-0.1)


def test_reset_clears_the_window_and_a_finished_episode_must_be_reset() -> None:
    env = guarded(repeats=3)
    env.step("dance"), env.step("dance")
    env.reset(2)
    assert not env.step("dance").done and not env.step("dance").done
    assert env.step("dance").done
    with pytest.raises(RuntimeError, match="reset"):
        env.step("turn left")
    with pytest.raises(RuntimeError, match="reset"):
        env.set_subgoal("explore")
    env.reset(2)
    assert not env.step("turn left").done


def test_the_guard_reads_through_to_the_env() -> None:
    inner = BabyAITextEnv(LOCAL, max_steps=17, invalid_penalty=0.3)
    env = LoopGuard(inner, repeats=4)
    assert env.max_steps == 17 and env.invalid_penalty == 0.3 and env.level == LOCAL
    assert env.unwrapped is inner.unwrapped
    env.reset(5)
    assert env.set_subgoal("go to the chartreuse ball") == inner.set_subgoal("go to the chartreuse ball")
    assert env.set_subgoal("explore") == "" and inner.subgoal == "explore"
    with pytest.raises(AttributeError):
        env.no_such_attribute


def test_the_guard_rejects_a_window_too_short_to_see_a_loop() -> None:
    with pytest.raises(ValueError, match="repeats >= 2"):
        LoopGuard(BabyAITextEnv(LOCAL), repeats=1)
