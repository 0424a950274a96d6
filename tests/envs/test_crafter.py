"""CrafterTextEnv on real crafter worlds: seeding, text, actions, subgoals, score, baseline.

A crafter reset generates a 64x64 world (about a second), so the tests share few episodes.
"""

from __future__ import annotations

import itertools
import math
import random
import re

import numpy as np
import pytest

from hieragent.envs.base import EVAL_SEED_OFFSET, make_env
from hieragent.envs.crafter import (
    ACHIEVEMENTS, ACTIONS, NAMES, CrafterTextEnv, balrog_progression, crafter_score,
)
from hieragent.envs.crafter_scripted import (
    ScriptedPlayer, expert_episode, expert_segments, play_scripted, scripted_steps,
)

from demo_helpers import replay_demo

NAME = NAMES[0]
_LINE = re.compile(r"^- ([a-z ]+): (\d+) steps? (up|down|left|right)(?: and (\d+) (left|right))?$")
_SIGN = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}


def seen(text: str) -> dict[str, tuple[int, int]]:
    """The ``You see`` lines of an observation as kind -> offset (right, down)."""
    out = {}
    for line in text.split("\n")[1:]:
        if not line.startswith("- "):
            break
        kind, n, word, m, word2 = _LINE.match(line).groups()
        dx, dy = (_SIGN[word][0] * int(n), _SIGN[word][1] * int(n))
        if m:
            dx += _SIGN[word2][0] * int(m)
        out[kind] = (dx, dy)
    return out


def world_cell(env: CrafterTextEnv, offset: tuple[int, int]) -> str | None:
    """What crafter's own semantic map holds at ``offset`` from the player, by name."""
    world = env.unwrapped._world
    semantic = env.unwrapped._sem_view()
    x, y = env.player.pos[0] + offset[0], env.player.pos[1] + offset[1]
    if not (0 <= x < semantic.shape[0] and 0 <= y < semantic.shape[1]):
        return None
    names = {i: m for m, i in world._mat_ids.items()}
    names.update({i: cls.__name__.lower() for cls, i in env.unwrapped._sem_view._obj_ids.items()})
    return names[int(semantic[x, y])]


# ---- reproducibility ----------------------------------------------------------------------


def script(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(ACTIONS + ["fly away", "Move_Left", " DO. "]) for _ in range(n)]


def run_script(env: CrafterTextEnv, seed: int, actions: list[str]) -> list:
    out: list = [env.reset(seed)]
    for action in actions:
        out.append(env.step(action))
    return out


def test_same_seed_reproduces_every_step_and_seeds_differ() -> None:
    actions = script(0, 80)
    a, b = CrafterTextEnv(NAME), CrafterTextEnv(NAME)
    first = run_script(a, 7, actions)
    assert run_script(b, 7, actions) == first
    other = run_script(a, 8, actions[:1])  # another episode in between must not leak
    assert other[0].text != first[0].text
    assert run_script(a, 7, actions) == first
    assert any(r.invalid for r in first[1:]) and any(r.reward != 0 for r in first[1:] if not r.invalid)


def test_long_episodes_replay_exactly_in_fresh_envs() -> None:
    # crafter despawns a creature picked from a set that iterates in memory-address order;
    # the env orders those sets, else these episodes part ways within some 100 steps
    for seed in (EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + 2):
        a, b = (CrafterTextEnv(NAME, max_steps=200, cache_worlds=0) for _ in range(2))
        a.reset(seed), b.reset(seed)
        assert list(scripted_steps(a)) == list(scripted_steps(b))


# ---- text ---------------------------------------------------------------------------------


def test_text_lists_the_nearest_of_each_kind_from_the_semantic_map() -> None:
    env = CrafterTextEnv(NAME)
    obs = env.reset(3)
    for action in ["move left"] * 3 + ["move up"] * 2 + ["noop"]:
        listed = seen(obs.text)
        view = {(dx, dy): world_cell(env, (dx, dy)) for dx in range(-4, 5) for dy in range(-3, 4)}
        kinds = {k for off, k in view.items() if off != (0, 0) and k is not None}
        assert set(listed) == kinds  # plants are not ripe this early, so names agree
        for kind, (dx, dy) in listed.items():
            assert view[(dx, dy)] == kind
            nearest = min(abs(x) + abs(y) for (x, y), k in view.items() if k == kind and (x, y) != (0, 0))
            assert abs(dx) + abs(dy) == nearest
        inv = env.player.inventory
        assert f"Health {inv['health']}/9, food {inv['food']}/9, drink {inv['drink']}/9" in obs.text
        obs = env.step(action).observation
    ahead = world_cell(env, (0, -1)) or "the edge of the world"
    assert f"You face {ahead} (up)." in obs.text


def test_walking_to_a_tree_and_collecting_wood_shows_in_the_text() -> None:
    env = CrafterTextEnv(NAME)
    obs, player = env.reset(EVAL_SEED_OFFSET), ScriptedPlayer(EVAL_SEED_OFFSET)
    while env.achievements["collect wood"] == 0:
        facing = tuple(int(v) for v in env.player.facing)
        ahead, text = world_cell(env, facing), obs.text
        result = env.step(player.act(env))
        obs = result.observation
    # the step before: a tree right ahead, one step away, as crafter's map has it
    word = next(w for w, d in _SIGN.items() if d == facing)
    assert ahead == "tree" and f"You face tree ({word})." in text and seen(text)["tree"] == facing
    inventory = [re.search(r"Inventory: (.*)\.", t)[1] for t in (text, obs.text)]
    assert "wood" not in inventory[0] and "wood 1" in inventory[1]
    health = [int(re.search(r"Health (\d)/9", t)[1]) for t in (text, obs.text)]
    assert result.reward == pytest.approx(1.0 + (health[1] - health[0]) / 10)  # crafter's unlock reward
    assert f"You face {world_cell(env, facing)} ({word})." in obs.text  # the tree is used up


# ---- actions and rules ----------------------------------------------------------------------


def test_actions_and_achievements_are_crafters() -> None:
    from crafter import constants

    assert ACTIONS == [a.replace("_", " ") for a in constants.actions] and len(ACTIONS) == 17
    assert sorted(ACHIEVEMENTS) == sorted(a.replace("_", " ") for a in constants.achievements)
    assert len(set(ACHIEVEMENTS)) == 22


def test_fuzzed_actions_are_invalid_steps_that_do_not_move_the_world() -> None:
    env = CrafterTextEnv(NAME, invalid_penalty=0.25)
    before = env.reset(0)
    rng = random.Random(0)
    junk = ["", "jump", "move", "make pickaxe", "place", "é" * 500, "do\nsleep", "move leftt", "7"]
    junk += ["".join(rng.choice("abcdefghij _.\n") for _ in range(rng.randint(1, 30))) for _ in range(20)]
    crafter_steps = env.unwrapped._step
    for k, action in enumerate(junk, start=1):
        result = env.step(action)
        assert result.invalid and not result.done and result.reward == -0.25 and not result.subgoal_done
        assert result.feedback.startswith("invalid action ") and result.feedback.endswith(", ".join(ACTIONS))
        assert result.observation == before and env.steps == k
    assert env.unwrapped._step == crafter_steps
    for messy in ["Move_Left", "  MOVE   left. ", "noop", "Do"]:
        result = env.step(messy)
        assert not result.invalid and result.feedback == ""
    assert env.unwrapped._step == crafter_steps + 4


def test_max_steps_counts_invalid_steps_and_ends_the_episode() -> None:
    assert CrafterTextEnv(NAME).max_steps == 500
    env = CrafterTextEnv(NAME, max_steps=3)
    env.reset(0)
    assert [env.step(a).done for a in ["noop", "fly", "noop"]] == [False, False, True]
    with pytest.raises(RuntimeError, match="reset"):
        env.step("noop")


def test_unknown_name_and_bad_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError, match="unknown env 'Crafter-v1'; known: Crafter-v0"):
        CrafterTextEnv("Crafter-v1")
    with pytest.raises(ValueError, match="max_steps"):
        CrafterTextEnv(NAME, max_steps=0)
    with pytest.raises(ValueError, match="cache_worlds must be >= 0"):
        CrafterTextEnv(NAME, cache_worlds=-1)
    with pytest.raises(ValueError, match="success_achievement must be None or one of collect wood"):
        CrafterTextEnv(NAME, success_achievement="win")
    with pytest.raises(ValueError, match="unknown env"):
        make_env("Crafter-Hard-v0")
    assert make_env(NAME, max_steps=9).max_steps == 9


# ---- subgoals and success -------------------------------------------------------------------


def test_subgoal_is_done_on_exactly_the_step_that_raises_its_count() -> None:
    env = CrafterTextEnv(NAME)
    obs = env.reset(EVAL_SEED_OFFSET + 1)
    assert obs.subgoals == ACHIEVEMENTS
    feedback = env.set_subgoal("win the game")
    assert feedback.startswith("cannot use subgoal 'win the game'; subgoals are achievements: collect wood,")
    assert env.subgoal is None
    assert env.set_subgoal(" Collect_Wood. ") == "" and env.subgoal == "collect wood"
    counts, flags, raised = 0, [], []
    for _, result in scripted_steps(env):
        flags.append(result.subgoal_done)
        raised.append(env.achievements["collect wood"] > counts)
        counts = env.achievements["collect wood"]
        if result.subgoal_done:
            assert env.subgoal is None
            assert env.set_subgoal("collect wood") == ""  # again: the next wood counts too
        if result.success:
            break
    assert flags == raised and sum(flags) >= 2
    assert result.success and "make wood pickaxe" in env.unlocked
    subgoals = result.observation.subgoals
    assert "make wood pickaxe" not in subgoals and "collect wood" in subgoals and "place table" in subgoals


def test_success_is_the_named_achievement_and_stays() -> None:
    env = CrafterTextEnv(NAME, success_achievement="place table")
    assert env.reset(EVAL_SEED_OFFSET + 2).mission.endswith("success is to place table")
    results = [r for _, r in itertools.islice(scripted_steps(env), 120)]
    success = [r.success for r in results]
    first = success.index(True)
    assert all(success[first:]) and not any(success[:first])
    # crafter's reward: +1 per first unlock, +-0.1 per health point
    health = env.player.inventory["health"]
    assert sum(r.reward for r in results) == pytest.approx(len(env.unlocked) + (health - 9) / 10)
    never = CrafterTextEnv(NAME, max_steps=40, success_achievement=None)
    never.reset(EVAL_SEED_OFFSET + 2)
    assert not any(r.success for _, r in play_scripted(never))


# ---- score ----------------------------------------------------------------------------------


def test_crafter_score_matches_a_float64_geometric_mean() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        rates = rng.uniform(0, 100, 22)
        direct = np.exp(np.mean(np.log(1.0 + rates.astype(np.float64)))) - 1.0
        assert crafter_score(list(rates)) == pytest.approx(direct, rel=1e-12)
        assert crafter_score(dict(zip(ACHIEVEMENTS, rates))) == pytest.approx(direct, rel=1e-12)
    assert crafter_score([0.0] * 22) == 0.0
    assert crafter_score([100.0] * 22) == pytest.approx(100.0)
    one = crafter_score({"collect wood": 100.0})  # others count 0
    assert one == pytest.approx(math.exp(math.log(101) / 22) - 1)
    with pytest.raises(ValueError, match="22 percentages"):
        crafter_score([50.0] * 21)
    with pytest.raises(ValueError, match="22 percentages"):
        crafter_score([0.5] * 21 + [101.0])
    with pytest.raises(ValueError, match="unknown achievements"):
        crafter_score({"collect gold": 1.0})


def test_balrog_progression_is_the_mean_share_of_achievements_per_episode() -> None:
    rng = np.random.default_rng(1)
    for _ in range(10):
        unlocked = rng.random((37, 22)) < rng.uniform(0, 1, 22)  # episodes x achievements
        per_episode = 100.0 * unlocked.astype(np.float64).sum(axis=1) / 22  # BALROG's definition
        rates = 100.0 * unlocked.mean(axis=0)
        assert balrog_progression(list(rates)) == pytest.approx(per_episode.mean(), rel=1e-12)
    with pytest.raises(ValueError, match="unknown achievements"):
        balrog_progression({"collect gold": 1.0})


# ---- baseline, demos, workers ---------------------------------------------------------------


def test_scripted_baseline_collects_wood_on_held_out_seeds() -> None:
    outcomes = []
    for seed in range(EVAL_SEED_OFFSET + 3, EVAL_SEED_OFFSET + 6):
        env = CrafterTextEnv(NAME)
        env.reset(seed)
        play_scripted(env, stop_at_success=True)
        assert "collect wood" in env.unlocked
        outcomes.append(env.steps)
    assert expert_episode(NAME, EVAL_SEED_OFFSET + 3) == (True, outcomes[0])


def test_expert_segments_end_on_their_unlocking_steps_and_a_demo_replays() -> None:
    from hieragent.rollout.demos import demonstrations

    env = CrafterTextEnv(NAME, max_steps=150)
    env.reset(4)
    segments = expert_segments(env)
    names = [s for s, _ in segments]
    assert names.count("collect wood") >= 2 and "make wood pickaxe" in names and all(a for _, a in segments)
    (demo,) = demonstrations(NAME, [4], max_steps=150)  # replays and checks every segment
    assert demo.source == "crafter-scripted" and demo.success
    assert [p.subgoal for p in demo.planner] == [s for s, _ in segments]
    assert [e.action for e in demo.executor] == [a for _, actions in segments for a in actions]
    results = replay_demo(env, demo, env.reset(4))
    assert results[-1].success and all(step.candidates == ACTIONS for step in demo.executor)
    short = CrafterTextEnv(NAME, max_steps=5)  # no wood pickaxe in 5 steps: no demo
    short.reset(4)
    assert expert_segments(short) == []


def test_worker_process_plays_the_same_episodes_as_in_process() -> None:
    from hieragent.envs.pool import EnvPool

    def play(pool: EnvPool) -> list:
        out: list = [pool.reset([5, 6])]
        out.append(pool.set_subgoals({0: "collect wood", 1: "fly"}))
        for actions in zip(script(1, 25), script(2, 25)):
            out.append(pool.step(dict(enumerate(actions))))
        return out

    local = play(EnvPool.make(NAME, 2, max_steps=25))
    with EnvPool.make(NAME, 2, workers=1, max_steps=25) as pool:
        assert play(pool) == local and not pool.failed
    assert local[1][1].startswith("cannot use subgoal 'fly'") and local[-1][0].done
