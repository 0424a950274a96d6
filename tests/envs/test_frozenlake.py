"""FrozenLakeTextEnv on gymnasium's random maps and on hand-made ones: text, rules, subgoals, expert."""

from __future__ import annotations

import random
from collections import deque

import pytest
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from hieragent.envs.frozenlake import (
    ACTIONS,
    MOVES,
    NAMES,
    SUBGOAL_RADIUS,
    FrozenLakeTextEnv,
    expert_episode,
    expert_segments,
)

SMALL, LARGE = "FrozenLake-4x4-v0", "FrozenLake-8x8-v0"
# The unreachable pocket at rows 0-1, column 3 is walled off by holes.
POCKET = ["SFHF", "FFHF", "FFHH", "FFFG"]


def lake(desc: list[str], **kwargs: object) -> FrozenLakeTextEnv:
    env = FrozenLakeTextEnv(SMALL if len(desc) == 4 else LARGE, **kwargs)  # type: ignore[arg-type]
    env.reset_to(desc)
    return env


def distance(desc: list[str]) -> int:
    """Shortest safe path length from S to G, by a BFS written independently of the env."""
    n = len(desc)
    start = next((r, row.index("S")) for r, row in enumerate(desc) if "S" in row)
    dist, queue = {start: 0}, deque([start])
    while queue:
        r, c = queue.popleft()
        if desc[r][c] == "G":
            return dist[(r, c)]
        for nr, nc in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
            if 0 <= nr < n and 0 <= nc < n and (nr, nc) not in dist and desc[nr][nc] != "H":
                dist[(nr, nc)] = dist[(r, c)] + 1
                queue.append((nr, nc))
    raise AssertionError("no path")


# ---- reproducibility ----------------------------------------------------------------------

SCRIPT = ["go right", "go down", "jump", "go right", "go down", "Go Left.", "go down", "go right"] * 3


def run_script(env: FrozenLakeTextEnv, seed: int) -> list:
    out: list = [env.reset(seed)]
    for action in SCRIPT:
        out.append(env.step(action))
        if out[-1].done:
            break
    return out


@pytest.mark.parametrize("slippery", [False, True])
def test_same_seed_reproduces_observations_and_step_results(slippery: bool) -> None:
    a, b = FrozenLakeTextEnv(LARGE, is_slippery=slippery), FrozenLakeTextEnv(LARGE, is_slippery=slippery)
    first = run_script(a, 7)
    assert run_script(b, 7) == first
    run_script(a, 3)  # another episode in between must not leak into the next reset
    assert run_script(a, 7) == first


@pytest.mark.parametrize("name", NAMES)
def test_map_is_gymnasiums_random_map_and_seeds_differ(name: str) -> None:
    env = FrozenLakeTextEnv(name)
    maps = []
    for seed in range(8):
        env.reset(seed)
        assert env.desc == generate_random_map(env.size, 0.8, seed)
        assert env.player == (0, 0) and env.goal == (env.size - 1, env.size - 1)
        maps.append(tuple(env.desc))
    assert len(set(maps)) >= 6


# ---- text ---------------------------------------------------------------------------------


def parse(text: str, size: int) -> tuple[list[str], tuple[int, int]]:
    """The grid rows (player cell as ``P``) and the position the last sentence states."""
    lines = text.split("\n")
    assert len(lines) == size + 2 and lines[size].startswith("Legend: P you, F frozen ice, H hole, G goal")
    grid = [line.split(" ") for line in lines[:size]]
    words = lines[-1].rstrip(".").replace(";", "").split()
    stated = (int(words[words.index("row") + 1]), int(words[words.index("column") + 1]))
    return ["".join(row) for row in grid], stated


@pytest.mark.parametrize("name", NAMES)
def test_text_matches_the_state_on_random_walks(name: str) -> None:
    env, rng = FrozenLakeTextEnv(name), random.Random(0)
    for seed in range(6):
        obs = env.reset(seed)
        while True:
            rows, stated = parse(obs.text, env.size)
            assert stated == env.player
            for r, row in enumerate(rows):
                for c, symbol in enumerate(row):
                    expect = "P" if (r, c) == env.player else env.desc[r][c].replace("S", "F")
                    assert symbol == expect
            result = env.step(rng.choice(ACTIONS))
            obs = result.observation
            if result.done:
                break


def test_text_of_a_hand_made_map_names_the_goal_and_the_end() -> None:
    env = lake(["SFFF", "FHFH", "FFFH", "HFFG"])
    assert env.observation().text == (
        "P F F F\nF H F H\nF F F H\nH F F G\n"
        "Legend: P you, F frozen ice, H hole, G goal; rows and columns count from 0 at the top left.\n"
        "You are at row 0 column 0; the goal is at row 3 column 3."
    )
    env.step("go right")
    result = env.step("go down")
    assert result.observation.text.endswith("You fell into the hole at row 1 column 1.")
    assert result.observation.text.split("\n")[1] == "F P F H"


# ---- actions and rules ----------------------------------------------------------------------


@pytest.mark.parametrize("action", ["jump", "", "up", "go forward", "é" * 500, "go\nleft now"])
def test_invalid_action_gives_feedback_and_penalty_and_does_not_move(action: str) -> None:
    env = FrozenLakeTextEnv(SMALL, invalid_penalty=0.25)
    before = env.reset(4)
    result = env.step(action)
    assert result.invalid and not result.done and not result.success
    assert result.reward == -0.25
    assert result.feedback.startswith("invalid action ")
    assert result.feedback.endswith("valid actions: go up, go down, go left, go right")
    assert len(result.feedback) < 200
    assert result.observation == before and env.player == (0, 0) and env.steps == 1


def test_actions_match_after_normalize_and_move_one_cell() -> None:
    env = lake(["SFFF", "FFFF", "FFFF", "FFFG"])
    assert env.observation().actions == ACTIONS == ["go up", "go down", "go left", "go right"]
    moves = [("  Go RIGHT. ", (0, 1)), ("go  down", (1, 1)), ("GO LEFT", (1, 0)), ("go up", (0, 0))]
    for messy, cell in moves:
        result = env.step(messy)
        assert not result.invalid and result.reward == 0.0 and env.player == cell


def test_walking_into_the_edge_is_a_valid_step_that_stays() -> None:
    env = lake(POCKET)
    for action in ("go up", "go left"):
        result = env.step(action)
        assert not result.invalid and not result.done and result.feedback == ""
        assert env.player == (0, 0) and result.reward == 0.0


def test_hole_ends_the_episode_as_a_failure_and_goal_pays_one() -> None:
    env = lake(POCKET)
    env.step("go right")
    result = env.step("go right")  # (0, 2) is a hole
    assert result.done and not result.success and result.reward == 0.0
    with pytest.raises(RuntimeError, match="reset"):
        env.step("go down")
    env.reset_to(POCKET)
    rewards = [env.step(a).reward for a in ["go down"] * 3 + ["go right"] * 2]
    assert rewards == [0.0] * 5
    result = env.step("go right")
    assert result.done and result.success and result.reward == 1.0


def test_max_steps_truncates_and_counts_invalid_steps() -> None:
    assert FrozenLakeTextEnv(SMALL).max_steps == 20 and FrozenLakeTextEnv(LARGE).max_steps == 50
    env = FrozenLakeTextEnv(SMALL, max_steps=4)
    env.reset(0)
    done = [env.step(a).done for a in ["go up", "fly", "go left", "go up"]]
    assert done == [False, False, False, True]
    with pytest.raises(RuntimeError, match="reset"):
        env.step("go up")


def test_unknown_name_and_bad_arguments_raise_value_error() -> None:
    known = r"unknown env 'FrozenLake-5x5-v0'; known: FrozenLake-4x4-v0, FrozenLake-8x8-v0"
    with pytest.raises(ValueError, match=known):
        FrozenLakeTextEnv("FrozenLake-5x5-v0")
    with pytest.raises(ValueError, match="max_steps"):
        FrozenLakeTextEnv(SMALL, max_steps=0)
    with pytest.raises(ValueError, match="one start S and one goal G"):
        FrozenLakeTextEnv(SMALL).reset_to(["FFFF", "FFFF", "FFFF", "FFFG"])


def test_make_env_builds_both_sizes() -> None:
    from hieragent.envs.base import make_env

    for name in NAMES:
        env = make_env(name, max_steps=9)
        assert isinstance(env, FrozenLakeTextEnv) and env.max_steps == 9
        assert env.reset(0).mission == "reach the goal without falling into a hole"


# ---- subgoals -------------------------------------------------------------------------------


def test_go_to_subgoal_is_done_on_exactly_the_step_that_arrives() -> None:
    env = lake(POCKET)
    assert env.set_subgoal("Go to row 2, column 1.") == "" and env.subgoal == "go to row 2 column 1"
    flags = [env.step(a).subgoal_done for a in ["go down", "go right", "go down", "go up", "go down"]]
    assert flags == [False, False, True, False, False] and env.subgoal is None
    assert env.set_subgoal("reach the goal") == ""
    flags = [env.step(a).subgoal_done for a in ["go down", "go right", "go right"]]
    assert flags == [False, False, True]


@pytest.mark.parametrize(
    ("subgoal", "feedback"),
    [
        ("cross the lake", "cannot use subgoal 'cross the lake'; use e.g. 'go to row 1 column 2'"),
        ("go to row 4 column 0", "row 4 column 0 is outside the 4x4 lake"),
        ("go to row 0 column 2", "row 0 column 2 is a hole"),
        ("go to row 0 column 0", "you are already at row 0 column 0"),
        ("go to row 1 column 3", "row 1 column 3 cannot be reached without crossing a hole"),
        ("go to row " + "9" * 5000 + " column 1", "cannot use subgoal"),
    ],
)
def test_set_subgoal_explains_what_cannot_be_grounded_and_clears(subgoal: str, feedback: str) -> None:
    env = lake(POCKET)
    assert env.set_subgoal("go to row 0 column 1") == ""
    assert env.set_subgoal(subgoal).startswith(feedback)
    assert env.subgoal is None and not env.step("go right").subgoal_done


@pytest.mark.parametrize("seed", range(4))
def test_subgoal_candidates_are_nearby_safe_reachable_and_grounded(seed: int) -> None:
    env = FrozenLakeTextEnv(LARGE)
    obs = env.reset(seed)
    for action in ("go right", "go down", "go right"):
        assert obs.subgoals[-1] == "reach the goal"
        for text in obs.subgoals[:-1]:
            words = text.split()
            r, c = int(words[3]), int(words[5])
            assert env.tile((r, c)) == "F" and (r, c) in env.reachable()
            assert 0 < abs(r - env.player[0]) + abs(c - env.player[1]) <= SUBGOAL_RADIUS
        assert all(env.set_subgoal(s) == "" for s in obs.subgoals)
        result = env.step(action)
        if result.done:
            break
        obs = result.observation


# ---- expert ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_expert_succeeds_on_every_seed_along_a_shortest_path(name: str) -> None:
    size = 4 if name == SMALL else 8
    for seed in range(20):  # threshold 1.0: a firm lake with a safe path is always crossed
        success, length = expert_episode(name, seed)
        assert success and length == distance(generate_random_map(size, 0.8, seed))
    assert expert_episode(name, 0, max_steps=2) == (False, 2)


def test_expert_mostly_crosses_slippery_ice() -> None:
    outcomes = [expert_episode(SMALL, seed, max_steps=100, is_slippery=True)[0] for seed in range(20)]
    assert sum(outcomes) >= 14  # 0.7; measured 0.92 on 50 seeds


@pytest.mark.parametrize("name", NAMES)
def test_expert_segments_drive_subgoal_done_and_succeed(name: str) -> None:
    env = FrozenLakeTextEnv(name)
    for seed in range(10):
        obs = env.reset(seed)
        segments = expert_segments(env)
        assert segments[-1][0] == "reach the goal" and len(segments) >= 2
        for subgoal, actions in segments:
            assert subgoal in obs.subgoals  # the planner is shown every expert subgoal
            assert env.set_subgoal(subgoal) == ""
            flags = []
            for action in actions:
                result = env.step(action)
                flags.append(result.subgoal_done)
                obs = result.observation
            assert flags == [False] * (len(flags) - 1) + [True]
        assert result.done and result.success


def test_expert_segments_refuse_slippery_ice() -> None:
    env = FrozenLakeTextEnv(SMALL, is_slippery=True)
    env.reset(0)
    with pytest.raises(ValueError, match="is_slippery=False"):
        expert_segments(env)


def test_module_defines_names_and_moves_consistently() -> None:
    assert NAMES == ["FrozenLake-4x4-v0", "FrozenLake-8x8-v0"]
    assert list(MOVES) == ACTIONS
