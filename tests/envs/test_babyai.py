"""BabyAITextEnv against real minigrid levels: text, actions, subgoals, registry, expert."""

from __future__ import annotations

import numpy as np
import pytest
from minigrid.core.world_object import Ball, Door, Key, Wall
from minigrid.utils.baby_ai_bot import BabyAIBot

from hieragent.envs import ACTIONS, BabyAITextEnv, check_env_name, known_envs, make_env
from hieragent.envs.expert import expert_action, expert_episode, expert_success_rate

LOCAL = "BabyAI-GoToLocal-v0"
RED_BALL = "BabyAI-GoToRedBallNoDists-v0"


def empty_room(agent: tuple[int, int] = (3, 3), direction: int = 0) -> BabyAITextEnv:
    """An 8x8 BabyAI room emptied by hand, agent at ``agent`` facing ``direction`` (0 = east).

    The level's own verifier is switched off, since the objects it tracks were removed.
    """
    env = BabyAITextEnv(RED_BALL)
    env.reset(0)
    u = env.unwrapped
    for x in range(1, u.width - 1):
        for y in range(1, u.height - 1):
            u.grid.set(x, y, None)
    u.agent_pos, u.agent_dir, u.carrying = agent, direction, None
    u.instrs.verify = lambda action: "continue"
    return env


def clauses(text: str) -> list[str]:
    """The comma-separated clauses of 'You see A, B. You carry C.' (the 'You see' part)."""
    seen = text.split(". You carry")[0].removeprefix("You see ").removesuffix(".")
    return seen.split(", ")


def state(env: BabyAITextEnv) -> tuple:
    u = env.unwrapped
    carrying = None if u.carrying is None else (u.carrying.color, u.carrying.type)
    return tuple(u.agent_pos), u.agent_dir, carrying, u.grid.encode().tobytes()


# ---- reproducibility ----------------------------------------------------------------

SCRIPT = ["go forward", "turn left", "go forward", "pick up", "jump", "turn right", "go forward",
          "toggle", "drop", "go forward", "turn right", "go forward", "go forward", "turn left"] * 3


def run_script(env: BabyAITextEnv, seed: int) -> list:
    out: list = [env.reset(seed)]
    for action in SCRIPT:
        result = env.step(action)
        out.append(result)
        if result.done:
            break
    return out


def test_same_seed_reproduces_observations_and_step_results() -> None:
    a, b = make_env(LOCAL), make_env(LOCAL)
    first = run_script(a, 7)
    assert run_script(b, 7) == first
    run_script(a, 3)  # a different episode in between must not leak into the next reset
    assert run_script(a, 7) == first
    assert run_script(b, 8)[0] != first[0]


# ---- text -------------------------------------------------------------------------------


def test_text_of_hand_placed_ball_counts_steps_left_and_forward() -> None:
    env = empty_room(agent=(3, 3), direction=0)  # facing east: right is south (+y)
    env.unwrapped.grid.set(5, 2, Ball("red"))  # 2 east, 1 north
    obs = env.observation()
    # East wall at x=7 is 4 ahead; north wall at y=0 is 3 to the left; south wall is 4 to
    # the right, outside the 7-wide view.
    assert obs.text == (
        "You see a red ball 1 step left and 2 steps forward, a wall 4 steps forward, a wall 3 steps left."
    )
    env.unwrapped.carrying = Key("blue")
    assert env.observation().text.endswith(" You carry a blue key.")


def relative(env: BabyAITextEnv, pos: tuple[int, int]) -> tuple[int, int]:
    """(right, forward) of a world cell, computed from world vectors, not from the view."""
    u = env.unwrapped
    d = np.array(pos) - np.array(u.agent_pos)
    return int(d @ u.right_vec), int(d @ u.dir_vec)


def expected_clause(color: str, kind: str, right: int, forward: int) -> str:
    side = f"{abs(right)} step{'s' * (abs(right) != 1)} {'right' if right > 0 else 'left'}"
    ahead = f"{forward} step{'s' * (forward != 1)} forward"
    where = " and ".join(p for p, n in ((side, right), (ahead, forward)) if n)
    return f"a {color} {kind} {where}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_text_places_every_object_in_view_in_all_four_directions(seed: int) -> None:
    env = make_env(LOCAL)
    env.reset(seed)
    u = env.unwrapped
    for _ in range(4):  # one room, no inner walls: everything in the 7x7 view is visible
        expected = []
        for x in range(u.width):
            for y in range(u.height):
                obj = u.grid.get(x, y)
                right, forward = relative(env, (x, y))
                if obj is not None and obj.type != "wall" and abs(right) <= 3 and 0 <= forward <= 6:
                    expected.append(expected_clause(obj.color, obj.type, right, forward))
        got = [c for c in clauses(env.observation().text) if not c.startswith("a wall")]
        assert sorted(got) == sorted(expected)
        env.step("turn left")


def test_text_lists_objects_nearest_first() -> None:
    env = empty_room()
    env.unwrapped.grid.set(6, 3, Key("green"))  # 3 forward
    env.unwrapped.grid.set(4, 3, Ball("red"))  # 1 forward
    assert clauses(env.observation().text)[:2] == ["a red ball 1 step forward", "a green key 3 steps forward"]


def test_closed_door_hides_what_is_behind_it_until_opened() -> None:
    env = empty_room(agent=(3, 3), direction=0)
    u = env.unwrapped
    for y in range(1, u.height - 1):  # a wall across the room at x=4 with a door in front
        u.grid.set(4, y, Door("blue") if y == 3 else Wall())
    u.grid.set(5, 3, Ball("red"))
    assert "red ball" not in env.observation().text
    assert "a blue door 1 step forward" in env.observation().text
    result = env.step("toggle")
    assert "an open blue door 1 step forward" in result.observation.text
    assert "a red ball 2 steps forward" in result.observation.text


# ---- actions ----------------------------------------------------------------------------


def test_observation_offers_the_six_babyai_text_actions() -> None:
    actions = ["turn left", "turn right", "go forward", "pick up", "drop", "toggle"]
    assert make_env(LOCAL).reset(0).actions == actions


@pytest.mark.parametrize("action", ["jump", "", "   ", "go forward please", "é" * 500, "turn\nleft now"])
def test_invalid_action_gives_feedback_and_penalty_and_does_not_move(action: str) -> None:
    env = BabyAITextEnv(LOCAL, invalid_penalty=0.25)
    before_obs = env.reset(4)
    before, steps = state(env), env.unwrapped.step_count
    result = env.step(action)
    assert result.invalid and not result.done
    assert result.reward == -0.25
    assert result.feedback.startswith("invalid action ")
    assert result.feedback.endswith("valid actions: " + ", ".join(ACTIONS))
    assert len(result.feedback) < 200  # long model output is not echoed back in full
    assert state(env) == before and result.observation == before_obs
    assert env.unwrapped.step_count == steps + 1


def test_invalid_actions_count_toward_max_steps() -> None:
    env = BabyAITextEnv(LOCAL, max_steps=3)
    env.reset(0)
    results = [env.step("fly") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert not results[-1].success
    with pytest.raises(RuntimeError, match="reset"):
        env.step("turn left")


def test_actions_match_after_strip_and_lower_case() -> None:
    a, b = make_env(LOCAL), make_env(LOCAL)
    a.reset(5), b.reset(5)
    pairs = [("  Turn LEFT ", "turn left"), ("Go Forward.", "go forward"), ("go  forward", "go forward")]
    for messy, clean in pairs:
        ra, rb = a.step(messy), b.step(clean)
        assert not ra.invalid and ra == rb


def test_max_steps_overrides_the_level_cap() -> None:
    env = BabyAITextEnv(LOCAL, max_steps=16)
    env.reset(0)
    assert env.max_steps == 16 and BabyAITextEnv(LOCAL).max_steps == 64
    done = [env.step("turn left").done for _ in range(16)]
    assert done == [False] * 15 + [True]


def test_success_reward_is_minigrids_time_discounted_one() -> None:
    env = BabyAITextEnv(RED_BALL)
    env.reset(1)
    bot = BabyAIBot(env.unwrapped)
    for length in range(1, env.max_steps + 1):
        result = env.step(expert_action(bot))
        if result.done:
            break
    assert result.success
    assert result.reward == pytest.approx(1 - 0.9 * length / env.max_steps)


# ---- subgoals ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_go_to_subgoal_done_exactly_when_facing_the_object(seed: int) -> None:
    env = BabyAITextEnv(RED_BALL)
    env.reset(seed)
    bot = BabyAIBot(env.unwrapped)
    assert env.set_subgoal("go to the red ball") == ""
    flags = []
    while True:
        result = env.step(expert_action(bot))
        front = env.unwrapped.grid.get(*env.unwrapped.front_pos)
        facing = front is not None and (front.color, front.type) == ("red", "ball")
        flags.append(result.subgoal_done)
        assert result.subgoal_done == facing
        if result.done:
            break
    # BabyAI's GoTo success is the same rule, so the subgoal and the mission end together.
    assert result.success and flags == [False] * (len(flags) - 1) + [True]
    assert env.subgoal is None


def test_go_to_subgoal_by_hand_flips_on_the_step_that_faces_the_ball() -> None:
    env = empty_room(agent=(2, 3), direction=0)
    env.unwrapped.grid.set(5, 3, Ball("red"))  # 3 forward
    assert env.set_subgoal("Go to the red ball") == "" and env.subgoal == "go to the red ball"
    assert [env.step("go forward").subgoal_done for _ in range(2)] == [False, True]
    assert env.set_subgoal("go to the red ball") == "you are already at the red ball"


def test_pick_up_then_drop_subgoals() -> None:
    env = empty_room()
    env.unwrapped.grid.set(4, 3, Ball("red"))
    assert env.set_subgoal("pick up the red ball") == ""
    assert not env.step("turn left").subgoal_done
    assert not env.step("turn right").subgoal_done
    result = env.step("pick up")
    assert result.subgoal_done and "You carry a red ball." in result.observation.text
    assert "drop the red ball" in result.observation.subgoals
    assert env.set_subgoal("pick up the red ball") == "you already carry the red ball"
    assert env.set_subgoal("drop the red ball") == ""
    assert env.step("drop").subgoal_done
    assert env.set_subgoal("drop the red ball") == "you do not carry a red ball"


def test_open_door_subgoal() -> None:
    env = empty_room()
    env.unwrapped.grid.set(4, 3, Door("yellow"))
    assert env.set_subgoal("open the yellow door") == ""
    assert not env.step("go forward").subgoal_done  # a closed door blocks
    assert env.step("toggle").subgoal_done
    assert env.set_subgoal("open the yellow door") == "the yellow door is already open"


def test_explore_done_when_an_unseen_object_comes_into_view() -> None:
    env = empty_room(agent=(3, 3), direction=0)
    env.unwrapped.grid.set(1, 3, Ball("red"))  # behind the agent
    env.unwrapped.grid.set(6, 3, Key("blue"))  # in view
    assert env.set_subgoal("explore") == ""
    assert not env.step("go forward").subgoal_done  # the key was already visible
    assert not env.step("go backward").subgoal_done
    assert env.step("turn left").subgoal_done  # the ball is now 3 steps left


@pytest.mark.parametrize(
    ("subgoal", "feedback"),
    [
        ("fly to the moon", "cannot use subgoal 'fly to the moon'"),
        ("go to the pink ball", "cannot use subgoal"),
        ("go to the purple key", "there is no purple key here"),
        ("pick up the red door", "cannot pick up a red door"),
        ("open the red ball", "cannot open a red ball"),
        ("open the blue door", "there is no blue door here"),
        ("drop the red ball", "you do not carry a red ball"),
    ],
)
def test_set_subgoal_explains_what_cannot_be_grounded_and_clears(subgoal: str, feedback: str) -> None:
    env = empty_room(agent=(3, 3), direction=0)
    env.unwrapped.grid.set(1, 3, Ball("red"))  # behind: a kept "explore" would fire on a turn
    assert env.set_subgoal("explore") == ""
    assert env.set_subgoal(subgoal).startswith(feedback)
    assert env.subgoal is None
    assert not env.step("turn left").subgoal_done


def test_subgoal_candidates_are_grounded_in_view_and_deduplicated() -> None:
    env = empty_room()
    grid = env.unwrapped.grid
    grid.set(4, 3, Ball("red")), grid.set(5, 2, Ball("red")), grid.set(6, 4, Door("grey"))
    grid.set(1, 3, Key("blue"))  # behind: not a candidate
    env.unwrapped.carrying = Key("green")
    assert env.observation().subgoals == [
        "go to the grey door", "pick up the red ball", "open the grey door", "drop the green key",
        "put the green key next to the red ball", "explore",
    ]  # facing a red ball already, so "go to the red ball" is not offered
    assert all(env.set_subgoal(s) == "" for s in env.observation().subgoals)


# ---- registry and expert ----------------------------------------------------------------


def test_unknown_env_name_raises_listing_known_names() -> None:
    for call in (check_env_name, make_env):
        with pytest.raises(ValueError, match=r"unknown env 'BabyAI-Foo-v0'; known: .*BabyAI-GoToLocal-v0"):
            call("BabyAI-Foo-v0")
    with pytest.raises(ValueError, match="MiniGrid-Empty-5x5-v0"):
        check_env_name("MiniGrid-Empty-5x5-v0")  # registered with gymnasium, but not BabyAI


@pytest.mark.parametrize("name", [LOCAL, RED_BALL, "BabyAI-GoToObj-v0", "BabyAI-Pickup-v0"])
def test_any_registered_babyai_id_makes_an_env(name: str) -> None:
    assert name in known_envs()
    check_env_name(name)
    obs = make_env(name).reset(0)
    assert obs.mission and obs.text.startswith("You see") and obs.subgoals[-1] == "explore"


def test_expert_solves_go_to_local() -> None:
    assert expert_success_rate(LOCAL, range(10)) >= 0.9
    success, length = expert_episode(LOCAL, 3)
    assert success and length > 1
    assert expert_episode(LOCAL, 3, max_steps=1) == (False, 1)  # the cap is passed through


def test_put_next_subgoal_needs_the_object_in_hand_and_completes_on_an_adjacent_drop() -> None:
    env = empty_room(agent=(3, 3), direction=0)  # facing east: a drop lands on (4, 3)
    env.unwrapped.carrying = Ball("red")
    env.unwrapped.grid.set(5, 3, Key("blue"))
    assert "put the red ball next to the blue key" in env.observation().subgoals
    assert env.set_subgoal("put the red ball next to the green box") == "there is no green box here"
    assert env.set_subgoal("put the red ball next to the blue key") == ""
    result = env.step("drop")
    assert result.subgoal_done and env.unwrapped.carrying is None
    assert env.set_subgoal("put the red ball next to the blue key") == "you do not carry a red ball"


def test_put_next_drop_away_from_the_other_object_does_not_complete() -> None:
    env = empty_room(agent=(2, 2), direction=0)  # the drop lands on (3, 2)
    env.unwrapped.carrying = Ball("red")
    env.unwrapped.grid.set(5, 4, Key("blue"))
    assert env.set_subgoal("put the red ball next to the blue key") == ""
    result = env.step("drop")
    assert env.unwrapped.carrying is None and not result.subgoal_done
