"""Solvers for TextArena's puzzles: the expert of the ``TextArena-`` family.

Hanoi's recursive optimal solution from the current state; for the 15-puzzle, breadth-first
searches that place one tile at a time with the placed tiles fixed (freeing the last one or
two at row and column ends), in ``FIFTEEN_ORDER``; Sudoku by backtracking. The other games
have none: ``expert_episode`` and ``expert_segments`` raise ``ValueError`` naming the game.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any

from hieragent.envs.textarena import FIFTEEN_ORDER, WITH_EXPERT, TextArenaEnv, family_of

Segments = list[tuple[str, list[str]]]


def hanoi_segments(towers: dict[str, list[int]], target: str = "C") -> Segments:
    """The optimal solution from ``towers`` as one segment per disk move onto ``target``:
    ``move disk k to tower C`` ends with disk k's last move, largest disk first."""
    where = {d: t for t, disks in towers.items() for d in disks}
    moves: list[tuple[int, str, str]] = []

    def tower(k: int, to: str) -> None:  # move disks 1..k onto ``to``, optimally
        if k == 0:
            return
        if where[k] == to:
            tower(k - 1, to)
            return
        spare = ({"A", "B", "C"} - {where[k], to}).pop()
        tower(k - 1, spare)
        moves.append((k, where[k], to))
        where[k] = to
        tower(k - 1, to)

    tower(max(where, default=0), target)
    segments, start = [], 0
    for i, (disk, _, to) in enumerate(moves):
        if to == target and all(m[0] != disk for m in moves[i + 1:]):
            segments.append((f"move disk {disk} to tower {target}", [f"[{a} {b}]" for _, a, b in moves[start: i + 1]]))
            start = i + 1
    return segments


# The 15-puzzle's slide names move a tile into the blank: the blank moves the other way.
_SLIDES = {"[up]": 4, "[down]": -4, "[left]": 1, "[right]": -1}  # blank index change


def _blank_moves(blank: int) -> list[tuple[str, int]]:
    r, c = divmod(blank, 4)
    return [(word, blank + d) for word, d in _SLIDES.items()
            if (word == "[up]" and r < 3) or (word == "[down]" and r > 0)
            or (word == "[left]" and c < 3) or (word == "[right]" and c > 0)]


def _place(flat: list[int], tiles: list[int], fixed: set[int]) -> list[str] | None:
    """Fewest slides bringing ``tiles`` home without moving the cells in ``fixed``
    (breadth-first over the blank and those tiles; the other tiles are alike)."""
    start = (flat.index(0), tuple(flat.index(t) for t in tiles))
    goal = tuple(t - 1 for t in tiles)
    parent: dict[tuple, tuple | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        if state[1] == goal:
            words = []
            while parent[state] is not None:
                state, word = parent[state]
                words.append(word)
            return words[::-1]
        blank, places = state
        for word, nxt in _blank_moves(blank):
            if nxt in fixed:
                continue
            new = (nxt, tuple(blank if p == nxt else p for p in places))
            if new not in parent:
                parent[new] = (state, word)
                queue.append(new)
    return None


def fifteen_solvable(flat: list[int]) -> bool:
    """Whether a 4x4 board (0 = blank) can reach the solved one: the inversions plus the
    blank's row counted from the bottom (from 1) must be odd."""
    tiles = [t for t in flat if t]
    inversions = sum(a > b for a, b in itertools.combinations(tiles, 2))
    return (inversions + 4 - flat.index(0) // 4) % 2 == 1


def fifteen_segments(board: list[list[int | None]]) -> Segments:
    """``place tile k`` segments in ``FIFTEEN_ORDER``; ``[]`` for an unsolvable board."""
    flat = [t or 0 for row in board for t in row]
    if not fifteen_solvable(flat):
        return []
    segments, placed = [], []
    for tile in FIFTEEN_ORDER:
        if all(flat[t - 1] == t for t in placed + [tile]):
            placed.append(tile)
            continue
        for free in range(min(3, len(placed) + 1)):  # free the last 0, 1, 2 placed tiles
            kept = placed[: len(placed) - free]
            words = _place(flat, placed[len(kept):] + [tile], {t - 1 for t in kept})
            if words is not None:
                break
        else:
            return []
        for word in words:
            blank = flat.index(0)
            nxt = blank + _SLIDES[word]
            flat[blank], flat[nxt] = flat[nxt], 0
        segments.append((f"place tile {tile}", words))
        placed.append(tile)
    return segments


def sudoku_solve(board: list[list[int]]) -> list[list[int]] | None:
    """The solved grid (backtracking, fewest candidates first), or ``None``."""
    grid = [row[:] for row in board]
    empty = [(r, c) for r in range(9) for c in range(9) if grid[r][c] == 0]

    def options(r: int, c: int) -> set[int]:
        box = {grid[i][j] for i in range(r // 3 * 3, r // 3 * 3 + 3) for j in range(c // 3 * 3, c // 3 * 3 + 3)}
        return set(range(1, 10)) - set(grid[r]) - {grid[i][c] for i in range(9)} - box

    def fill() -> bool:
        open_cells = [(r, c) for r, c in empty if grid[r][c] == 0]
        if not open_cells:
            return True
        r, c = min(open_cells, key=lambda rc: len(options(*rc)))
        for digit in sorted(options(r, c)):
            grid[r][c] = digit
            if fill():
                return True
        grid[r][c] = 0
        return False

    return grid if fill() else None


def sudoku_segments(board: list[list[int]]) -> Segments:
    """One ``fill row r`` segment per row with empty cells, left to right."""
    solved = sudoku_solve(board)
    if solved is None:
        return []
    return [(f"fill row {r + 1}", [f"[{r + 1} {c + 1} {solved[r][c]}]" for c in range(9) if board[r][c] == 0])
            for r in range(9) if 0 in board[r]]


def expert_segments(env: TextArenaEnv) -> Segments:
    """The solver's episode from the current state as ``(subgoal, actions)`` segments."""
    g, gs = env.game_name, env.game.state.game_state
    if g == "TowerOfHanoi":
        return hanoi_segments({t: list(d) for t, d in gs["towers"].items()})
    if g == "FifteenPuzzle":
        return fifteen_segments(env.game.board)
    if g == "Sudoku":
        return sudoku_segments(gs["board"])
    raise ValueError(f"{env.name} has no expert; TextArena games with one: {', '.join(WITH_EXPERT)}")


def expert_episode(name: str, seed: int, max_steps: int | None = None, **kwargs: Any) -> tuple[bool, int]:
    """Play the solver's episode; returns ``(success, length)``, ``(False, 0)`` when the
    solver finds nothing (an unsolvable 15-puzzle)."""
    if family_of(name) not in WITH_EXPERT:
        raise ValueError(f"{name} has no expert; TextArena games with one: {', '.join(WITH_EXPERT)}")
    env = TextArenaEnv(name, max_steps=max_steps, **kwargs)
    env.reset(seed)
    length = 0
    for _, actions in expert_segments(env):
        for action in actions:
            result = env.step(action)
            length += 1
            if result.done:
                return result.success, length
    return False, 0
