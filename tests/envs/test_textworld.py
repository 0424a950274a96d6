"""TextWorldEnv on real generated TextWorld games: generation, play, subgoals and the expert.

Games are generated once per module into a temporary games_dir (a few seconds); nothing
touches the user's cache.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hieragent.envs.base import EVAL_SEED_OFFSET
from hieragent.envs.textworld import NAMES, TextWorldEnv, expert_episode, walkthrough_segments
from hieragent.envs.textworld_games import (
    LEVELS, default_games_dir, game_path, generate, is_complete, main, wins,
)

EASY, MEDIUM = "TextWorld-Easy-v0", "TextWorld-Medium-v0"
EASY_SEEDS = range(5)
HELDOUT = EVAL_SEED_OFFSET
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def games(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Easy seeds 0-4 and the first held-out seed, and Medium seed 0, made by the CLI."""
    games_dir = str(tmp_path_factory.mktemp("textworld"))
    main(["--level", EASY, "--train", str(len(EASY_SEEDS)), "--heldout", "1", "--games-dir", games_dir,
          "--jobs", "2"])
    main(["--level", MEDIUM, "--train", "1", "--heldout", "0", "--games-dir", games_dir])
    return games_dir


def walk(env: TextWorldEnv, seed: int) -> list:
    """Observations and step results along the walkthrough of ``seed``."""
    trace = [env.reset(seed)]
    for command in env.walkthrough:
        trace.append(env.step(command))
    return trace


def generate_argv(seed: int, games_dir: Path) -> list[str]:
    """A command line that generates Easy game ``seed`` into ``games_dir``."""
    code = f"generate({EASY!r}, {seed}, {str(games_dir)!r})"
    return [sys.executable, "-c", f"from hieragent.envs.textworld_games import generate; {code}"]


def snapshot(env: TextWorldEnv) -> tuple:
    return env.room, frozenset(env._state["facts"]), env.score, env.observation()


# ---- generation ---------------------------------------------------------------------------


def test_cli_generates_train_and_heldout_seeds_then_skips_them(games: str) -> None:
    paths = [game_path(EASY, s, games) for s in [*EASY_SEEDS, HELDOUT]] + [game_path(MEDIUM, 0, games)]
    assert all(is_complete(p) for p in paths)
    assert sorted(p.name for p in Path(games, EASY).iterdir()) == sorted(
        f"{s}.{ext}" for s in [*EASY_SEEDS, HELDOUT] for ext in ("json", "z8")
    )  # no temporary folders and no Inform 7 source left behind
    mtimes = [p.stat().st_mtime_ns for p in paths]
    start = time.monotonic()
    main(["--level", EASY, "--train", str(len(EASY_SEEDS)), "--heldout", "1", "--games-dir", games])
    assert time.monotonic() - start < 5 and [p.stat().st_mtime_ns for p in paths] == mtimes


def test_generation_is_deterministic_across_processes_and_hash_seeds(games: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run(generate_argv(3, tmp_path), check=True, cwd=ROOT, env=env, timeout=120)
    ours, theirs = game_path(EASY, 3, games), game_path(EASY, 3, tmp_path)
    assert ours.with_suffix(".json").read_bytes() == theirs.with_suffix(".json").read_bytes()
    a, b = TextWorldEnv(EASY, games_dir=games), TextWorldEnv(EASY, games_dir=str(tmp_path))
    assert walk(a, 3) == walk(b, 3)  # same walkthrough, same observations and rewards


def test_two_envs_on_the_same_seed_agree_step_for_step(games: str) -> None:
    a, b = TextWorldEnv(EASY, games_dir=games), TextWorldEnv(EASY, games_dir=games)
    for seed in EASY_SEEDS:
        assert walk(a, seed) == walk(b, seed)
    assert walk(a, 1) == walk(a, 1)  # replaying on the same env too


def test_seeds_give_different_games(games: str) -> None:
    env = TextWorldEnv(EASY, games_dir=games)
    missions = {env.reset(s).mission for s in [*EASY_SEEDS, HELDOUT]}
    assert len(missions) == len(EASY_SEEDS) + 1


def test_a_killed_generation_leaves_the_game_complete_or_absent(tmp_path: Path) -> None:
    proc = subprocess.Popen(generate_argv(7, tmp_path), cwd=ROOT, start_new_session=True)
    level_dir, deadline = tmp_path / EASY, time.monotonic() + 60
    try:  # kill it as soon as it has written something: mid-generation
        while not any(level_dir.glob(".gen-*/*")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    path = game_path(EASY, 7, tmp_path)
    assert is_complete(path) or not path.exists()
    assert not any(level_dir.glob("*.ni"))
    env = TextWorldEnv(EASY, games_dir=str(tmp_path))
    env.reset(7)  # a missing game is generated on demand
    assert is_complete(path)
    assert expert_episode(EASY, 7, games_dir=str(tmp_path)) == (True, len(env.walkthrough))


def test_games_dir_defaults_to_the_hieragent_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from hieragent.models.loading import cache_dir

    monkeypatch.setenv("HIERAGENT_CACHE", str(tmp_path))
    assert default_games_dir() == cache_dir() / "textworld" == tmp_path / "textworld"
    assert game_path(EASY, 12) == tmp_path / "textworld" / EASY / "12.z8"


def test_importing_the_env_module_does_not_import_textworld() -> None:
    code = "import sys, hieragent.envs.textworld as m; print(m.NAMES, 'textworld' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == f"{NAMES} False"


# ---- playing ------------------------------------------------------------------------------


def test_levels_and_unknown_names() -> None:
    assert NAMES == ["TextWorld-Easy-v0", "TextWorld-Medium-v0", "TextWorld-Hard-v0"] == list(LEVELS)
    for call in (TextWorldEnv, generate):
        with pytest.raises(ValueError, match=r"unknown env 'TextWorld-Foo-v0'; known: TextWorld-Easy-v0"):
            call("TextWorld-Foo-v0", 0)


def test_make_env_builds_a_textworld_env(games: str) -> None:
    from hieragent.envs import make_env

    env = make_env(EASY, games_dir=games, max_steps=7)
    assert isinstance(env, TextWorldEnv) and env.max_steps == 7
    assert env.reset(0).actions


@pytest.mark.parametrize("seed", EASY_SEEDS)
def test_observation_is_clean_text_with_sorted_admissible_commands(games: str, seed: int) -> None:
    env = TextWorldEnv(EASY, games_dir=games)
    for obs in [env.reset(seed)] + [r.observation for r in walk(env, seed)[1:]]:
        assert obs.mission.startswith(tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")) and "$$" not in obs.mission
        assert obs.text.startswith("-= ") or obs.text[0].isupper()
        for text in (obs.mission, obs.text):
            assert "\n" not in text and "  " not in text and ">" not in text and "***" not in text
        assert obs.actions == sorted(obs.actions) and len(set(obs.actions)) == len(obs.actions)
        assert "look" in obs.actions and "inventory" in obs.actions
        assert "You are carrying" in obs.text


def test_score_changes_are_the_rewards_and_sum_to_the_max_score(games: str) -> None:
    env = TextWorldEnv(EASY, games_dir=games)
    for seed in EASY_SEEDS:
        results = walk(env, seed)[1:]
        rewards = [r.reward for r in results]
        # These quests are worth one point, scored by the walkthrough's last command.
        assert sum(rewards) == env.max_score == 1 and rewards[-1] == 1
        assert [r.done for r in results] == [False] * (len(results) - 1) + [True] and results[-1].success


@pytest.mark.parametrize(("name", "seeds"), [(EASY, [*EASY_SEEDS, HELDOUT]), (MEDIUM, [0])])
def test_walkthrough_expert_solves_every_game(games: str, name: str, seeds: list[int]) -> None:
    outcomes = [expert_episode(name, s, games_dir=games) for s in seeds]
    assert sum(ok for ok, _ in outcomes) / len(outcomes) == 1.0
    env = TextWorldEnv(name, games_dir=games)
    for seed, (_, length) in zip(seeds, outcomes):
        env.reset(seed)
        assert length == len(env.walkthrough) <= LEVELS[name].quest_length < env.max_steps


GARBAGE = ["jump", "", "  ", "go to the moon", "é" * 500, "take\nit", "look please", "open bureau"]


@pytest.mark.parametrize("action", GARBAGE)  # the bureau is in the next room
def test_invalid_action_gives_feedback_and_penalty_and_does_not_move(games: str, action: str) -> None:
    env = TextWorldEnv(EASY, invalid_penalty=0.25, games_dir=games)
    obs = env.reset(1)
    before = snapshot(env)
    result = env.step(action)
    assert result.invalid and not result.done and not result.success and not result.subgoal_done
    assert result.reward == -0.25 and result.observation == obs
    assert result.feedback.startswith("invalid action ") and len(result.feedback) < 250
    named = result.feedback.split("valid actions include: ")[1].split(", ")
    assert len(named) == 3 and set(named) <= set(obs.actions)
    assert snapshot(env) == before and env.steps == 1


def test_actions_match_after_strip_and_lower_case(games: str) -> None:
    a, b = TextWorldEnv(EASY, games_dir=games), TextWorldEnv(EASY, games_dir=games)
    a.reset(0), b.reset(0)
    for command in a.walkthrough:
        messy = f"  {command.upper()}. "
        ra, rb = a.step(messy), b.step(command)
        assert not ra.invalid and ra == rb


def test_max_steps_truncates_and_counts_invalid_steps(games: str) -> None:
    env = TextWorldEnv(EASY, max_steps=3, games_dir=games)
    env.reset(0)
    assert [env.step("fly").done for _ in range(3)] == [False, False, True]
    with pytest.raises(RuntimeError, match="reset"):
        env.step("look")
    env.reset(0)
    walkthrough = env.walkthrough
    assert len(walkthrough) == 3
    results = [env.step("look"), env.step(walkthrough[0]), env.step(walkthrough[1])]
    assert [r.done for r in results] == [False, False, True] and not results[-1].success
    assert TextWorldEnv(EASY).max_steps == LEVELS[EASY].max_steps
    with pytest.raises(ValueError, match="max_steps"):
        TextWorldEnv(EASY, max_steps=0)


# ---- subgoals -----------------------------------------------------------------------------
# Easy seed 1, as TextWorld 1.7 generates it (pyproject pins the minor version): the player
# starts in the spare room carrying a worm; the studio, south, holds a closed bureau with a
# laptop; walkthrough: go south, open bureau, take laptop from bureau.


@pytest.mark.parametrize(("name", "seed"), [*((EASY, s) for s in EASY_SEEDS), (EASY, HELDOUT), (MEDIUM, 0)])
def test_walkthrough_segments_complete_one_subgoal_each(games: str, name: str, seed: int) -> None:
    env = TextWorldEnv(name, games_dir=games)
    env.reset(seed)
    segments = walkthrough_segments(env)
    assert [c for _, commands in segments for c in commands] == env.walkthrough
    for subgoal, commands in segments:
        moves = [c.startswith("go ") for c in commands]
        assert subgoal.startswith("go to the ") and all(moves) or commands == [subgoal]
    env.reset(seed)
    for subgoal, commands in segments:
        assert env.set_subgoal(subgoal) == "" and env.subgoal == subgoal
        flags = [env.step(c).subgoal_done for c in commands]
        assert flags == [False] * (len(commands) - 1) + [True] and env.subgoal is None
    assert env.score == env.max_score and not env._live


def test_subgoals_are_known_rooms_and_world_changing_commands(games: str) -> None:
    env = TextWorldEnv(EASY, games_dir=games)
    obs = env.reset(1)  # the mission names the studio, south of the spare room where we start
    assert env.room == "spare room" and "go to the studio" in obs.subgoals
    assert "go to the spare room" not in obs.subgoals
    result = env.step("go south")
    assert env.room == "studio" and "go to the spare room" in result.observation.subgoals
    for obs in (env.reset(s) for s in EASY_SEEDS):
        commands = [s for s in obs.subgoals if not s.startswith("go to the ")]
        assert set(commands) <= set(obs.actions)
        assert not [c for c in commands if c.split()[0] in ("look", "inventory", "examine", "go")]
        assert all(env.set_subgoal(s) == "" for s in obs.subgoals)


@pytest.mark.parametrize(
    ("subgoal", "feedback"),
    [
        ("fly to the moon", "cannot use subgoal 'fly to the moon' now; use 'go to the <room>' or e.g. "),
        ("go to the moon", "there is no room 'moon'; rooms you know: spare room, studio"),
        ("Go to the Spare Room.", "you are already in the spare room"),
        ("go south", "name the room instead of 'go south': 'go to the <room>'"),
        ("look", "'look' changes nothing"),
        ("examine worm", "'examine worm' changes nothing"),
        ("open bureau", "cannot use subgoal 'open bureau' now"),  # the bureau is in the studio
        ("", "cannot use subgoal '' now"),
        ("x" * 300, "cannot use subgoal 'xxxxxxxx"),
    ],
)
def test_set_subgoal_explains_what_cannot_be_grounded_and_clears(
    games: str, subgoal: str, feedback: str
) -> None:
    env = TextWorldEnv(EASY, games_dir=games)
    env.reset(1)
    assert env.set_subgoal("drop worm") == ""
    message = env.set_subgoal(subgoal)
    assert message.startswith(feedback) and len(message) < 200
    assert env.subgoal is None and not env.step("drop worm").subgoal_done


def test_go_to_an_unvisited_room_is_done_on_arrival_only(games: str) -> None:
    env = TextWorldEnv(EASY, games_dir=games)
    env.reset(1)
    assert env.set_subgoal("go to the studio") == ""
    flags = [env.step(c).subgoal_done for c in ["look", "drop worm", "go south", "go north", "go south"]]
    assert flags == [False, False, True, False, False]


def test_command_subgoal_needs_that_command(games: str) -> None:
    env = TextWorldEnv(EASY, games_dir=games)
    env.reset(1)
    env.step("go south")
    assert env.set_subgoal("open bureau") == ""
    flags = [env.step(c).subgoal_done for c in ["drop worm", "Open Bureau", "close bureau"]]
    assert flags == [False, True, False]


def test_ambiguous_names_are_rejected_and_a_no_op_command_completes_nothing(tmp_path: Path) -> None:
    """TextWorld's quirk: "take Henderson's latchkey from chest" is admissible, but Inform 7
    cannot tell "chest" from "Henderson's chest" and only asks "Which do you mean"."""
    from textworld.generator.game import Event, Quest
    from textworld.generator.maker import GameMaker

    maker = GameMaker()
    room = maker.new_room("cellar")
    maker.set_player(room)
    plain, fancy = maker.new(type="c", name="chest"), maker.new(type="c", name="Henderson's chest")
    plain.add_property("open"), fancy.add_property("closed")
    key = maker.new(type="o", name="Henderson's latchkey")
    plain.add(key)
    room.add(plain, fancy)
    maker.quests = [Quest(win_events=[Event(conditions={maker.new_fact("in", key, maker.inventory)})])]
    maker.build()
    seed, take = 999_999, "take Henderson's latchkey from chest"
    path = Path(maker.compile(str(game_path(EASY, seed, tmp_path))))
    assert not wins(path, [take])  # so generate() would draw another game for this seed
    env = TextWorldEnv(EASY, games_dir=str(tmp_path))
    env.reset(seed)
    assert take in env.observation().actions and env.set_subgoal(take) == ""
    result = env.step(take)
    assert not result.invalid and not result.subgoal_done and result.reward == 0 and not result.done
    assert result.observation.text.startswith("Which do you mean, the ")
    assert env.subgoal == take
