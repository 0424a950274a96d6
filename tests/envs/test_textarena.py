"""TextArenaEnv on TextArena's real single-player games: seeds, moves, rewards, subgoals, experts."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from hieragent.envs.base import EVAL_SEED_OFFSET, make_env
from hieragent.envs.pool import EnvPool
from hieragent.envs.textarena import NAMES, SOLVED, TextArenaEnv, family_of
from hieragent.envs.textarena_solvers import expert_episode, expert_segments, fifteen_solvable, hanoi_segments
from hieragent.rollout.demos import demonstrations

HANOI, FIFTEEN, SUDOKU = "TextArena-TowerOfHanoi-v0", "TextArena-FifteenPuzzle-v0", "TextArena-Sudoku-v0"
MINES, GUESS, LIGHTS, MASTER = ("TextArena-Minesweeper-v0-small", "TextArena-GuessTheNumber-v0",
                                "TextArena-LightsOut-v0", "TextArena-Mastermind-v0")
SOLVABLE = [HANOI, "TextArena-TowerOfHanoi-v0-medium", FIFTEEN, "TextArena-Sudoku-v0-very-easy", SUDOKU]
GARBAGE = ["", "hello", "[", "[]", "[up", "[1 2", "[" + "9" * 5000 + "]", "[1 1 " + "7" * 5000 + "]",
           "[-1 -1]", "[0 0 0 0 0 0]", "é" * 300, "\x00\n\t", "[A C] [C A] [A B]", "[9 9 9]", "[up] [down]", "[[A C]"]


def play(env: TextArenaEnv, seed: int, rng_seed: int = 0, steps: int = 12) -> list:
    """A random episode: listed moves, garbage and game-format guesses, from one rng."""
    rng = random.Random(rng_seed)
    obs = env.reset(seed)
    out: list = [obs]
    for _ in range(steps):
        pool = obs.actions + GARBAGE[:4] + ["[1 2 3 4]", "[5 5 5]", "[2 3]", "[7]"]
        result = env.step(rng.choice(pool))
        out.append(result)
        obs = result.observation
        if result.done:
            break
    return out


# ---- seeds ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_replays_step_for_step_and_leaves_global_random_alone(name: str) -> None:
    a, b = TextArenaEnv(name, error_allowance=None), TextArenaEnv(name, error_allowance=None)
    random.seed(99)
    expected = random.random()
    random.seed(99)
    first = play(a, 7)
    assert random.random() == expected  # the games seed and draw from their own state
    play(b, 3)  # another episode, and the global generator moved, must not leak in
    random.random()
    assert play(b, 7) == first and play(a, 7) == first
    episodes = {repr(play(a, seed)) + repr(a.game.state.game_state) for seed in range(4)}  # secrets too
    assert len(episodes) == (1 if family_of(name) == "TowerOfHanoi" else 4)  # Hanoi has no chance


def test_minesweeper_mines_laid_on_the_first_move_follow_the_seed() -> None:
    a, b = TextArenaEnv(MINES), TextArenaEnv(MINES)
    a.reset(5)
    b.reset(6)
    b.step("[2 2]")  # b lays seed 6's mines between a's reset and a's first move
    b.reset(5)
    assert a.step("[2 2]") == b.step("[2 2]")
    assert a.game.grid == b.game.grid and sum(row.count(-1) for row in a.game.grid) == 5


def test_a_lights_out_seed_whose_presses_cancel_out_is_redrawn_the_same_way_each_time() -> None:
    a, b = TextArenaEnv(LIGHTS), TextArenaEnv(LIGHTS)
    obs = a.reset(10067)  # TextArena's own reset divides by zero lights on for this seed
    assert "O" in obs.text and obs == b.reset(10067) and obs != b.reset(10068)


# ---- moves -------------------------------------------------------------------------------------

ILLEGAL = {HANOI: "[C A]", MINES: "[9 9]", GUESS: "[21]", LIGHTS: "[5 0]", MASTER: "[1 1 2 3]",
           SUDOKU: "[1 1 1]", FIFTEEN: None}


@pytest.mark.parametrize("name", list(ILLEGAL))
def test_listed_moves_are_accepted_and_an_illegal_one_is_invalid_and_changes_nothing(name: str) -> None:
    env, rng = TextArenaEnv(name, invalid_penalty=0.25, error_allowance=None), random.Random(1)
    obs = env.reset(11)
    for _ in range(5):
        if not obs.actions:
            break
        result = env.step(rng.choice(obs.actions))
        if name == MINES and result.invalid:  # an unrevealed cell may hide a mine: TextArena's invalid move
            assert "You hit a mine" in result.feedback
            continue
        assert not result.invalid and result.feedback == ""
        obs = result.observation
        if result.done:
            return
    illegal = ILLEGAL[name]
    if name == FIFTEEN:  # a slide the blank's edge forbids
        illegal = next(m for m in ("[up]", "[down]", "[left]", "[right]") if m not in obs.actions) \
            if len(obs.actions) < 4 else None
    if name == SUDOKU:  # a digit that breaks the rules in the first empty cell
        board = env.game.state.game_state["board"]
        r, c = next((r, c) for r in range(9) for c in range(9) if board[r][c] == 0)
        illegal = f"[{r + 1} {c + 1} {next(d for d in board[r] if d)}]"
    if illegal is None:
        return
    assert illegal not in obs.actions
    state = repr(env.game.state.game_state)
    result = env.step(illegal)
    assert result.invalid and not result.done and result.reward == -0.25
    assert result.feedback.startswith(f"invalid move '{illegal}': ") and len(result.feedback) < 200
    assert result.observation == obs and repr(env.game.state.game_state) == state


@pytest.mark.parametrize("name", NAMES)
def test_garbage_never_raises_and_is_an_invalid_step(name: str) -> None:
    env = TextArenaEnv(name, error_allowance=None, max_steps=100)
    before = env.reset(2)
    for text in GARBAGE[:-5]:
        result = env.step(text)
        assert result.invalid and not result.done and result.observation == before, text
    for text in GARBAGE[-5:] + ["".join(chr(random.Random(i).randrange(32, 0x3000)) for _ in range(50))
                                for i in range(10)]:
        env.step(text)  # may be valid: several moves, or a lucky one; it must not raise


def test_a_second_invalid_move_in_a_row_ends_the_game_by_textarena_rule() -> None:
    env = TextArenaEnv(HANOI)
    env.reset(0)
    assert env.step("?").invalid and not env.step("[A C]").invalid  # a valid move resets the count
    first, second = env.step("?"), env.step("?")
    assert not first.done and second.done and second.invalid and not second.success
    assert second.reward == pytest.approx(-0.1)  # the penalty, plus the game's completion 0
    assert "second" not in second.feedback and "valid '[source] [target]'" in second.feedback


def test_an_answer_with_several_moves_is_played_whole_or_not_at_all() -> None:
    env = TextArenaEnv(HANOI)
    env.reset(0)
    result = env.step("[A C] [A C]")  # the second would put disk 2 on disk 1: roll back the first too
    assert result.invalid and "larger disk on a smaller disk" in result.feedback
    assert env.game.state.game_state["towers"] == {"A": [3, 2, 1], "B": [], "C": []}
    result = env.step("[A C] [A B]")  # TextArena plays every move of an answer
    assert not result.invalid and env.game.state.game_state["towers"] == {"A": [3], "B": [2], "C": [1]}


def test_mission_is_the_prompt_and_text_the_board_without_player_framing() -> None:
    env = TextArenaEnv(FIFTEEN)
    obs = env.reset(3)
    assert obs.mission.startswith("You are playing the 15-Puzzle game.") and "Player 0" not in obs.mission
    rows = obs.text.split("\n")
    assert len(rows) == 4 and sorted(rows[0].split() + rows[1].split() + rows[2].split() + rows[3].split()) \
        == sorted([str(t) for t in range(1, 16)] + ["__"])
    hanoi = TextArenaEnv(HANOI)
    assert hanoi.reset(0).text == "A: [3, 2, 1]\nB: []\nC: []"
    assert hanoi.step("[A C]").observation.text == "You moved disk 1 from A to C.\nA: [3, 2]\nB: []\nC: [1]"
    guess = TextArenaEnv(GUESS)
    assert guess.reset(0).text == "No guesses yet."
    guess.step("[1]")
    text = guess.step("[20]").observation.text
    assert text.count("The target number is") == 2  # the history stays in a game with no board


# ---- rewards -----------------------------------------------------------------------------------


def test_rewards_are_the_games_win_and_completion() -> None:
    env = TextArenaEnv(HANOI)
    env.reset(0)
    moves = [a for _, actions in expert_segments(env) for a in actions]
    results = [env.step(m) for m in moves]
    assert [r.reward for r in results] == [0.0] * 6 + [1.0] and results[-1].done and results[-1].success
    assert "Congratulations" in results[-1].observation.text and results[-1].observation.actions == []
    env = TextArenaEnv(HANOI, max_steps=2)
    env.reset(0)
    env.step("[A B]")  # disk 1 to B, then disk 1 to C: nothing placed in order on C
    end = env.step("[B C]")
    assert end.done and not end.success and end.reward == 0.0
    env = TextArenaEnv(SUDOKU, max_steps=1)
    env.reset(0)
    (_, [move, *_]), *_ = expert_segments(env)
    end = env.step(move)  # one of the empty cells right: the game's completion fraction
    empty = sum(row.count(0) for row in env.game.game_board)
    assert end.done and end.reward == pytest.approx(1 / empty)


def test_fifteen_puzzle_win_is_a_win_despite_textarena_calling_a_two_player_method() -> None:
    seed = next(s for s in range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + 10) if expert_episode(FIFTEEN, s)[0])
    env = TextArenaEnv(FIFTEEN)
    env.reset(seed)
    results = [env.step(a) for _, actions in expert_segments(env) for a in actions]
    assert results[-1].success and results[-1].reward == 1.0 and not any(r.done for r in results[:-1])


# ---- subgoals ----------------------------------------------------------------------------------


def test_hanoi_subgoal_is_done_when_that_disk_lands_on_that_tower() -> None:
    env = TextArenaEnv(HANOI)
    obs = env.reset(0)
    assert "move disk 2 to tower B" in obs.subgoals and "move disk 3 to tower A" not in obs.subgoals
    assert env.set_subgoal("Move disk 2 to tower B.") == ""
    flags = [env.step(m).subgoal_done for m in ("[A C]", "[A B]", "[C B]")]
    assert flags == [False, True, False] and env.subgoal is None
    assert env.set_subgoal("move disk 1 to tower B") == "'move disk 1 to tower B' is already done"
    assert env.set_subgoal("move disk 7 to tower B").startswith("there is no disk 7")
    assert env.set_subgoal("fill row 2").startswith("cannot use subgoal 'fill row 2'; use e.g. 'solve the puzzle'")
    assert env.subgoal is None


def test_sudoku_row_and_solve_subgoals_are_done_on_the_completing_step() -> None:
    env = TextArenaEnv("TextArena-Sudoku-v0-very-easy")
    env.reset(4)
    segments = expert_segments(env)
    row, actions = segments[0]
    assert row in env.observation().subgoals and env.set_subgoal(row) == ""
    assert [env.step(a).subgoal_done for a in actions] == [False] * (len(actions) - 1) + [True]
    assert env.set_subgoal(row).endswith("is already done") and env.set_subgoal("fill row 10").startswith("there is no")
    assert env.set_subgoal(SOLVED) == ""
    rest = [a for _, acts in segments[1:] for a in acts]
    flags = [env.step(a).subgoal_done for a in rest]
    assert flags == [False] * (len(rest) - 1) + [True]


def test_fifteen_place_tile_needs_the_tiles_before_it_home() -> None:
    env = TextArenaEnv(FIFTEEN)
    env.reset(EVAL_SEED_OFFSET + 1)
    assert env.set_subgoal("place tile 16").startswith("there is no tile 16")
    segments = expert_segments(env)
    (first, moves), (second, more) = segments[:2]
    assert env.set_subgoal(second) == ""  # tile 2 counts only once tile 1 is home too
    flags = [env.step(m).subgoal_done for m in moves + more]
    assert flags == [False] * (len(flags) - 1) + [True]


# ---- experts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SOLVABLE)
def test_the_solver_wins_held_out_seeds(name: str) -> None:
    seeds = range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + 6)
    outcomes = [expert_episode(name, s) for s in seeds]
    for seed, (success, length) in zip(seeds, outcomes):
        if family_of(name) == "FifteenPuzzle" and not success:  # only an unsolvable board may fail
            env = TextArenaEnv(name)
            env.reset(seed)
            assert length == 0 and not fifteen_solvable([t or 0 for row in env.game.board for t in row])
        else:
            assert success and 0 < length <= TextArenaEnv(name).max_steps
    assert sum(ok for ok, _ in outcomes) >= 2
    if name == HANOI:
        assert {n for _, n in outcomes} == {7}  # optimal


def test_hanoi_solver_is_optimal_from_a_scrambled_state() -> None:
    segments = hanoi_segments({"A": [3], "B": [2, 1], "C": []})
    assert segments == [("move disk 3 to tower C", ["[A C]"]), ("move disk 2 to tower C", ["[B A]", "[B C]"]),
                        ("move disk 1 to tower C", ["[A C]"])]
    assert hanoi_segments({"A": [], "B": [], "C": [3, 2, 1]}) == []
    env = TextArenaEnv(HANOI)
    env.reset(0)
    for move in ("[A B]", "[A C]", "[B C]", "[A B]"):  # off the optimal path, then the solver again
        env.step(move)
    for subgoal, actions in expert_segments(env):
        assert env.set_subgoal(subgoal) == ""
        flags = [env.step(a).subgoal_done for a in actions]
        assert flags == [False] * (len(flags) - 1) + [True]
    assert env.won


def test_games_without_a_solver_say_so() -> None:
    with pytest.raises(ValueError, match="TextArena-Minesweeper-v0-small has no expert; .*TowerOfHanoi"):
        expert_episode(MINES, 0)
    env = TextArenaEnv(LIGHTS)
    env.reset(0)
    with pytest.raises(ValueError, match="TextArena-LightsOut-v0 has no expert"):
        expert_segments(env)


@pytest.mark.parametrize("name", [HANOI, FIFTEEN, SUDOKU])
def test_recorded_demos_replay_to_success(name: str) -> None:
    demos = list(demonstrations(name, range(3)))  # record() checks every subgoal_done on the way
    assert demos and all(d.source == "textarena-solver" and d.success for d in demos)
    env = make_env(name)
    for demo in demos:
        obs = env.reset(demo.seed)
        assert obs.mission == demo.mission and demo.planner[0].observation == obs.text
        results = [env.step(step.action) for step in demo.executor]
        assert results[-1].success and not any(r.invalid for r in results)


# ---- construction and workers --------------------------------------------------------------------


def test_bad_names_and_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError, match=r"unknown env 'TextArena-Wordle-v0'; known: TextArena-TowerOfHanoi-v0"):
        TextArenaEnv("TextArena-Wordle-v0")
    with pytest.raises(ValueError, match="max_steps must be >= 1"):
        TextArenaEnv(HANOI, max_steps=0)
    with pytest.raises(ValueError, match="error_allowance must be >= 0"):
        TextArenaEnv(HANOI, error_allowance=-1)
    env = make_env(HANOI, max_steps=9)
    assert isinstance(env, TextArenaEnv) and env.max_steps == 9 and TextArenaEnv(SUDOKU).max_steps == 100
    with pytest.raises(RuntimeError, match="reset"):
        env.step("[A C]")


def test_importing_the_module_does_not_import_textarena() -> None:
    code = "import sys, hieragent.envs.textarena as m; print(len(m.NAMES), 'textarena' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(len(NAMES)), "False"]


def test_a_worker_process_plays_the_same_episode() -> None:
    script = ["[A C]", "nonsense", "[A B]", "[C B]", "[A C]"]
    solo = TextArenaEnv(HANOI)
    expected = [solo.reset(4)] + [solo.step(a) for a in script]
    with EnvPool.make(HANOI, 2, workers=1) as pool:
        got = [pool.reset([4, 5])[0]] + [pool.step({0: a})[0] for a in script]
    assert got == expected
