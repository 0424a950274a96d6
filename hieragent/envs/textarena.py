"""TextArena's single-player puzzles (Guertler et al., arXiv:2504.11442) behind ``TextEnv``.

``TextArena-<id>`` is TextArena 0.7.4's env ``<id>`` with the settings it registers, played
without its observation wrappers. A game takes the model's text as it is, in its own action
format (``[A C]`` for Hanoi, ``[row col number]`` for Sudoku, ``[up]`` for the 15-puzzle).

Kept: single-player games that need no network, no downloaded data and no LLM, and
whose randomness follows the seed: TowerOfHanoi, FifteenPuzzle, Sudoku, Minesweeper,
GuessTheNumber, LightsOut, Mastermind. Rejected: Wordle, Hangman, WordLadder and
WordSearch (they fetch nltk word lists at run time); TwentyQuestions and GuessWho (an LLM
plays the other side); Klondike (its module does not import: a syntax error in 0.7.4);
Countdown (it sends messages whose type is a plain string); Slitherlink (it passes
arguments out of order: an invalid move's reward is its reason). Not checked yet, so left
out: 2048, Bandit, Blackjack, Crosswords, Cryptarithm, LogicPuzzle, PegJump, RushHour,
Secretary, Set, ThreeCardMonte, UltimateTexasHoldem (FrozenLake and Sokoban have families
of their own).

Choices where TextArena leaves one:
  * Seeds: a game seeds Python's global ``random`` and draws from it, also while playing
    (Minesweeper lays its mines on the first move). Each env keeps its own generator
    state and swaps it in around every call into the game, so envs never share draws
    and the caller's ``random`` state is left as it was.
  * Invalid moves are what the game rejects (bad format, illegal move, a Sudoku digit
    that is not the solution's, a Minesweeper mine). Such a step is ``invalid`` with the
    game's reason as feedback and ``-invalid_penalty``, and the game is rolled back to
    before it (Hanoi applies several moves of one answer in turn, so a later bad one
    would otherwise leave the earlier ones done). TextArena's own rule stays: with
    ``error_allowance`` 1 (its default), a second invalid move in a row ends the game
    with its completion reward; ``error_allowance=None`` never ends it.
    Minesweeper counts a mine as an invalid move too (TextArena's rule): forgiven once.
    Text that makes the game's parser raise (``int()`` of 5000 digits) is invalid as well,
    but does not count toward ``error_allowance``: the game never saw a move.
  * Reward: 0 on a valid move that does not end the game; the game's reward on the step
    that ends it (1 for a win, else its completion fraction in [0, 1]); ``success`` is a
    win. ``max_steps`` (default: the game's turn limit) counts invalid steps too; when it
    ends the episode first, the reward is the completion fraction, as at the game's limit.
  * Text: the game's messages of the step (hints, what a move did), then the board as
    the game renders it; in GuessTheNumber and Mastermind, which have no board, every
    message since the start. The mission is the game's prompt, with "Player 0" made "you".
  * FifteenPuzzle shuffles all 16! boards, so half of its boards cannot be solved (kept:
    that is the benchmark); and on a win it calls a two-player method that its
    single-player state lacks, which we supply on our instance as the single-player win.
  * LightsOut fails to start (a division by zero) when its random presses cancel out and
    no light is on, e.g. seed 10067: such a seed is redrawn as ``seed + k * 2**32`` for
    the first k that works.

Actions listed (``Observation.actions``): Hanoi's legal moves, the 15-puzzle's slides,
Minesweeper's unrevealed cells (a mine among them is TextArena's invalid move), the
unguessed numbers, LightsOut's cells. None for Sudoku (only the solution's digit is
accepted, so a list would give it away) or Mastermind (360 codes).

Subgoals: ``solve the puzzle`` in every game, done on the win; Hanoi ``move disk 3 to
tower C``, done when that disk lands there; 15-puzzle ``place tile 7``, done when tile 7
and every tile before it in ``FIFTEEN_ORDER`` are home (rows 1-2, then columns, then the
last 2x2); Sudoku ``fill row 4``, done when the row's last empty cell is filled. What is
already true is refused.

Experts (source ``textarena-solver``) are in ``hieragent.envs.textarena_solvers``.
"""

from __future__ import annotations

import copy
import importlib
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hieragent.envs.base import TextEnv, normalize, quote
from hieragent.types import Observation, StepResult

GAMES = [
    "TowerOfHanoi-v0", "TowerOfHanoi-v0-medium", "FifteenPuzzle-v0", "Sudoku-v0-very-easy", "Sudoku-v0",
    "Minesweeper-v0-small", "Minesweeper-v0", "GuessTheNumber-v0", "LightsOut-v0", "Mastermind-v0",
]
NAMES = [f"TextArena-{g}" for g in GAMES]
SOLVED = "solve the puzzle"
WITH_EXPERT = ("TowerOfHanoi", "FifteenPuzzle", "Sudoku")
HISTORY_GAMES = ("GuessTheNumber", "Mastermind")  # no board: the text is every message so far
MAX_ACTIONS = 100
FIFTEEN_ORDER = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 10, 14, 11, 12, 15]
_LIGHTS_REDRAW = 2**32
_DISK = re.compile(r"^move disk (\d{1,2}) to (?:tower|peg) ([abc])$")
_TILE = re.compile(r"^place tile (\d{1,2})$")
_ROW = re.compile(r"^fill row (\d{1,2})$")
_REASON = re.compile(r"Reason: (.*?) Please resubmit", re.S)
# "Player 0" framing of TextArena's multi-player core, made second person.
_FRAMING = [("You are Player 0. ", ""), ("Player 0 has", "You have"), ("Player 0 have", "You have"),
            ("Player 0", "You")]


def family_of(name: str) -> str:
    """``TextArena-Sudoku-v0-easy`` -> ``Sudoku``."""
    return name.removeprefix("TextArena-").split("-")[0]


def unframe(text: str) -> str:
    for old, new in _FRAMING:
        text = text.replace(old, new)
    return text.strip()


@dataclass(frozen=True)
class _Goal:
    """A grounded subgoal: its text and the test of the game that says it is done."""

    text: str
    test: Callable[[Any], bool]


class TextArenaEnv(TextEnv):
    """One of TextArena's single-player games behind the ``TextEnv`` interface.

    Args:
        name: One of ``NAMES``: ``TextArena-`` and TextArena's env id.
        max_steps: Step cap per episode, invalid steps included; ``None``: the game's turn limit.
        invalid_penalty: Subtracted from the reward of a move the game rejects.
        error_allowance: Invalid moves in a row the game forgives; the next one ends it
            (TextArena's rule, default 1). ``None``: invalid moves never end the game.
    """

    world = "a TextArena puzzle game"

    def __init__(self, name: str, max_steps: int | None = None, invalid_penalty: float = 0.1,
                 error_allowance: int | None = 1) -> None:
        super().__init__(invalid_penalty)
        if name not in NAMES:
            raise ValueError(f"unknown env {name!r}; known: {', '.join(NAMES)}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        if error_allowance is not None and error_allowance < 0:
            raise ValueError(f"error_allowance must be >= 0 or None, got {error_allowance}")
        self.name, self.game_name = name, family_of(name)
        self.error_allowance = error_allowance
        from textarena.envs.registration import ENV_REGISTRY  # slow (2 s), so not at module level

        self._spec = ENV_REGISTRY[name.removeprefix("TextArena-")]
        self._max_steps = max_steps if max_steps is not None else int(self._spec.kwargs["max_turns"])
        self.game: Any = None  # TextArena's env, unwrapped
        self._rng: Any = None  # this env's state of Python's random module
        self.steps = 0
        self.mission, self.text, self._history = "", "", []
        self._subgoal: _Goal | None = None
        self._live = False

    @property
    def max_steps(self) -> int:
        return self._max_steps

    @property
    def subgoal(self) -> str | None:
        return self._subgoal.text if self._subgoal else None

    def _new_game(self) -> Any:
        module, _, cls = self._spec.entry_point.partition(":")
        return getattr(importlib.import_module(module), cls)(**self._spec.kwargs)

    def _in_own_random(self, call: Callable[[], Any]) -> Any:
        """``call()`` with this env's ``random`` state swapped in; the caller's is restored."""
        outside = random.getstate()
        try:
            if self._rng is not None:
                random.setstate(self._rng)
            return call()
        finally:
            self._rng = random.getstate()
            random.setstate(outside)

    def reset(self, seed: int) -> Observation:
        game = self._new_game()
        self._rng = None
        for k in range(100):
            try:
                self._in_own_random(lambda: game.reset(num_players=1, seed=seed + k * _LIGHTS_REDRAW))
                break
            except ZeroDivisionError:  # LightsOut with no light on; see the module docstring
                continue
        state = game.state
        state.error_allowance = self.error_allowance if self.error_allowance is not None else 1 << 62
        if not hasattr(state, "set_winners"):  # FifteenPuzzle's win; see the module docstring
            state.set_winners = lambda player_ids, reason: state.set_outcome(reward=1, reason=reason)
        self.game, self.steps, self._subgoal, self._live = game, 0, None, True
        messages = self._drain()
        self.mission = unframe("\n".join(m for m, kind in messages if kind == "PROMPT"))
        self._history = [m for m, kind in messages if kind != "PROMPT"]
        self.text = self._render([m for m, _ in messages if _ != "PROMPT"])
        return self.observation()

    def _drain(self) -> list[tuple[str, str]]:
        """The game's messages to the player since the last call, as (text, type name)."""
        messages = self.game.state.observations[0]
        self.game.state.observations[0] = []
        return [(unframe(text), kind.name) for _, text, kind in messages if kind.name != "PLAYER_ACTION"]

    def _render(self, messages: list[str]) -> str:
        if self.game_name in HISTORY_GAMES:
            return "\n".join(self._history) or "No guesses yet."
        board = _board(self.game_name, self.game)
        said = [m for m in messages if not m.startswith(("Current Board", "Game Board", "Board state",
                                                         "Current grid state"))]
        return "\n".join(said + [board])

    def step(self, action: str) -> StepResult:
        if not self._live:
            raise RuntimeError(f"{self.name}: step() needs a live episode; call reset(seed) first")
        self.steps += 1
        before, rng = copy.deepcopy(self.game), self._rng
        try:
            self._in_own_random(lambda: self.game.step(action))
            crashed = ""
        except Exception as exc:  # its parser choked on model output; see the module docstring
            crashed = f"the game could not read it ({type(exc).__name__})"
        state = self.game.state
        messages = self._drain()
        # TextArena clears ``made_invalid_move`` before returning; the error count stays up.
        invalid = bool(crashed) or state.error_count > 0 or bool(state.game_info[0].get("invalid_move"))
        reward, feedback, subgoal_done = 0.0, "", False
        if invalid:
            reason = crashed or next((_REASON.search(m)[1] for m, _ in messages if _REASON.search(m)),
                                     state.game_info[0].get("reason", ""))
            feedback = f"invalid move {quote(action)}: {unframe(reason).removeprefix('Invalid Move: ')}"
            reward = -self.invalid_penalty
            if crashed or not state.done:  # the game did not move: roll it back, keep its error count
                if not crashed:
                    before.state.error_count = state.error_count
                self.game, self._rng = before, rng
        else:
            said = [m for m, kind in messages]
            self._history += said
            self.text = self._render(said)
            if self._subgoal is not None and self._subgoal.test(self.game):
                subgoal_done, self._subgoal = True, None
        over, won = bool(self.game.state.done), self.won
        if over:
            reward += float((self.game.state.rewards or {0: 0.0})[0])
            self.text += "\n" + unframe(str(self.game.state.game_info[0].get("reason", "")))
        elif self.steps >= self.max_steps:  # our cap came first: what the game gives at its own
            reward += float(self.game._get_percentage_completion())
            self.text += "\nThe step limit has been reached."
        done = over or self.steps >= self.max_steps
        if won and self._subgoal is not None and self._subgoal.text == SOLVED:
            subgoal_done, self._subgoal = True, None
        self._live = not done
        return StepResult(self.observation(), reward, done, success=won, subgoal_done=subgoal_done,
                          invalid=invalid, feedback=feedback)

    @property
    def won(self) -> bool:
        """Whether the game ended in a win (its reward 1, not ended by an invalid move)."""
        state = self.game.state
        return bool(state.done and (state.rewards or {0: 0})[0] >= 1 and not state.game_info[0].get("invalid_move"))

    def observation(self) -> Observation:
        over = self.game.state.done
        actions = [] if over else _legal(self.game_name, self.game)[:MAX_ACTIONS]
        return Observation(self.mission, self.text, actions, [] if over else self._candidates())

    # ---- subgoals -------------------------------------------------------------------------

    def _candidates(self) -> list[str]:
        g, game = self.game_name, self.game
        out = [SOLVED]
        if g == "TowerOfHanoi":
            towers = game.state.game_state["towers"]
            out += [f"move disk {d} to tower {t}" for d in range(game.num_disks, 0, -1) for t in "ABC"
                    if d not in towers[t]]
        elif g == "FifteenPuzzle":
            out += [f"place tile {t}" for t in FIFTEEN_ORDER if not _tiles_home(game, t)]
        elif g == "Sudoku":
            board = game.state.game_state["board"]
            out += [f"fill row {r + 1}" for r in range(9) if 0 in board[r]]
        return out

    def _ground(self, text: str) -> _Goal | str:
        key, g, game = normalize(text), self.game_name, self.game
        goal: _Goal | None = None
        if key == SOLVED:
            goal = _Goal(SOLVED, lambda game: False)  # done on the win, in step()
        elif g == "TowerOfHanoi" and (m := _DISK.match(key)):
            disk, tower = int(m[1]), m[2].upper()
            if not 1 <= disk <= game.num_disks:
                return f"there is no disk {disk}; the disks are 1 to {game.num_disks}"
            goal = _Goal(f"move disk {disk} to tower {tower}",
                         lambda game: disk in game.state.game_state["towers"][tower])
        elif g == "FifteenPuzzle" and (m := _TILE.match(key)):
            tile = int(m[1])
            if not 1 <= tile <= 15:
                return f"there is no tile {tile}; the tiles are 1 to 15"
            goal = _Goal(f"place tile {tile}", lambda game: _tiles_home(game, tile))
        elif g == "Sudoku" and (m := _ROW.match(key)):
            row = int(m[1])
            if not 1 <= row <= 9:
                return f"there is no row {row}; the rows are 1 to 9"
            goal = _Goal(f"fill row {row}", lambda game: 0 not in game.state.game_state["board"][row - 1])
        if goal is None:
            examples = "', '".join(self._candidates()[:3])
            return f"cannot use subgoal {quote(text)}; use e.g. '{examples}'"
        if goal.test(game):
            return f"'{goal.text}' is already done"
        return goal


def _board(game_name: str, game: Any) -> str:
    """The board as the game itself renders it."""
    if game_name == "TowerOfHanoi":
        return game._render_board().strip()
    if game_name == "FifteenPuzzle":
        return game._render_board(game.board).rstrip()
    if game_name == "Sudoku":
        return game._get_grid_string_with_indices()
    if game_name == "Minesweeper":
        return game._render_board().rstrip()
    return game._grid_to_string(game.state.game_state["grid"])  # LightsOut


def _legal(game_name: str, game: Any) -> list[str]:
    """The moves the game would accept now, in its format, where they are cheap to list."""
    gs = game.state.game_state
    if game_name == "TowerOfHanoi":
        towers = gs["towers"]
        return [f"[{a} {b}]" for a in "ABC" for b in "ABC"
                if a != b and towers[a] and (not towers[b] or towers[b][-1] > towers[a][-1])]
    if game_name == "FifteenPuzzle":
        r, c = game._get_empty_position()
        return [m for m, ok in (("[up]", r < 3), ("[down]", r > 0), ("[left]", c < 3), ("[right]", c > 0)) if ok]
    if game_name == "Minesweeper":
        return [f"[{r} {c}]" for r in range(game.rows) for c in range(game.cols) if not game.revealed[r][c]]
    if game_name == "GuessTheNumber":
        return [f"[{n}]" for n in range(game.min_number, game.max_number + 1) if n not in game.guessed_numbers]
    if game_name == "LightsOut":
        return [f"[{r} {c}]" for r in range(game.size) for c in range(game.size)]
    return []  # Sudoku, Mastermind: see the module docstring


def _tiles_home(game: Any, tile: int) -> bool:
    """Whether ``tile`` and every tile before it in ``FIFTEEN_ORDER`` are home."""
    flat = [t for row in game.board for t in row]
    return all(flat[t - 1] == t for t in FIFTEEN_ORDER[: FIFTEEN_ORDER.index(tile) + 1])
