"""FrozenLake as text, after RAGEN (arXiv:2504.20073): walk over a random lake to the goal.

A seed fixes the map, drawn by gymnasium's ``generate_random_map(size, p, seed)`` (start at
the top left, goal at the bottom right, a safe path guaranteed), and gymnasium's
``FrozenLakeEnv`` moves the player, slipping sideways when ``is_slippery``. Rows and columns
count from 0 at the top left, in the text and in subgoals alike.

Rewards are gymnasium's: 1 on the step that reaches the goal, 0 otherwise. Stepping into a
hole ends the episode as a failure. Walking into the lake's edge is a valid step that stays.
"""

from __future__ import annotations

import re
from collections import deque
from typing import TYPE_CHECKING

from hieragent.envs.base import TextEnv, invalid_action_feedback, normalize, quote
from hieragent.types import Observation, StepResult

if TYPE_CHECKING:
    from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv

Cell = tuple[int, int]  # (row, column)

# The same four words as Sokoban's, so one executor prompt serves both games.
ACTIONS = ["go up", "go down", "go left", "go right"]
MOVES: dict[str, Cell] = {"go up": (-1, 0), "go down": (1, 0), "go left": (0, -1), "go right": (0, 1)}
_GYM_ACTION = {"go left": 0, "go down": 1, "go right": 2, "go up": 3}  # gymnasium's numbering

SIZES = {"FrozenLake-4x4-v0": 4, "FrozenLake-8x8-v0": 8}
NAMES = list(SIZES)
# About three times the shortest path (6 on 4x4, 14 on 8x8), as slack for a learner.
DEFAULT_MAX_STEPS = {4: 20, 8: 50}
# "go to" candidates are safe cells within this many steps (Manhattan) of the player: short
# lists, and no hint of the route (listing the expert's path would give it away).
SUBGOAL_RADIUS = 3
# Waypoints of ``expert_segments`` are this many steps apart, so that each one is among the
# candidates the planner is shown (SUBGOAL_RADIUS).
EXPERT_LEG = 3
MISSION = "reach the goal without falling into a hole"
LEGEND = "Legend: P you, F frozen ice, H hole, G goal; rows and columns count from 0 at the top left."
_GO_TO = re.compile(r"^go to row (\d{1,3}),? column (\d{1,3})$")  # bounded: int() of 5000 digits raises


class FrozenLakeTextEnv(TextEnv):
    """A random FrozenLake map behind the ``TextEnv`` interface.

    Args:
        name: One of ``NAMES``; fixes the lake's size.
        max_steps: Step cap per episode; ``None``: 20 on 4x4, 50 on 8x8.
        invalid_penalty: Subtracted from the reward of an invalid action.
        is_slippery: Whether the ice is slippery (gymnasium's rule: the intended direction
            with probability 1/3, else one of the two perpendicular ones). Off by default,
            so that plans hold and ``expert_segments`` exists; RAGEN's env config turns it on.
        p: Probability that a generated cell is frozen rather than a hole (RAGEN uses 0.8).
    """

    world = "a frozen lake grid"

    def __init__(
        self,
        name: str,
        max_steps: int | None = None,
        invalid_penalty: float = 0.1,
        is_slippery: bool = False,
        p: float = 0.8,
    ) -> None:
        super().__init__(invalid_penalty)
        if name not in SIZES:
            raise ValueError(f"unknown env {name!r}; known: {', '.join(NAMES)}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        if not 0 < p <= 1:
            raise ValueError(f"p (the chance of a frozen cell) must be in (0, 1], got {p}")
        self.name = name
        self.size = SIZES[name]
        self.is_slippery = is_slippery
        self.p = p
        self._max_steps = max_steps if max_steps is not None else DEFAULT_MAX_STEPS[self.size]
        self.desc: list[str] = []  # gymnasium's map rows: S start, F frozen, H hole, G goal
        self.player: Cell = (0, 0)
        self.steps = 0
        self._env: FrozenLakeEnv | None = None
        self._subgoal: tuple[str, Cell] | None = None
        self._live = False

    @property
    def max_steps(self) -> int:
        return self._max_steps

    @property
    def unwrapped(self) -> FrozenLakeEnv:
        """gymnasium's env (its transition table ``P`` feeds the expert)."""
        if self._env is None:
            raise RuntimeError(f"{self.name}: call reset(seed) first")
        return self._env

    @property
    def subgoal(self) -> str | None:
        """The current subgoal; cleared when set_subgoal fails or the subgoal is achieved."""
        return self._subgoal[0] if self._subgoal else None

    @property
    def goal(self) -> Cell:
        return next((r, row.index("G")) for r, row in enumerate(self.desc) if "G" in row)

    def tile(self, cell: Cell) -> str:
        """``F``, ``H`` or ``G`` (the start is frozen ice like any other)."""
        letter = self.desc[cell[0]][cell[1]]
        return "F" if letter == "S" else letter

    def reset(self, seed: int) -> Observation:
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        return self.reset_to(generate_random_map(self.size, self.p, seed), seed)

    def reset_to(self, desc: list[str], seed: int = 0) -> Observation:
        """Start an episode on a given map (gymnasium's letters: one ``S``, one ``G``, ``F``
        and ``H``); ``seed`` seeds the slips. For hand-made maps in tests, fixed curricula."""
        from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv

        n = self.size
        letters = "".join(desc)
        if len(desc) != n or any(len(row) != n for row in desc) or set(letters) - set("SFHG"):
            raise ValueError(f"a {self.name} map is {n} rows of {n} letters from S, F, H, G; got {desc}")
        if letters.count("S") != 1 or letters.count("G") != 1:
            raise ValueError(f"a map needs exactly one start S and one goal G; got {desc}")
        self.desc = list(desc)
        self._env = FrozenLakeEnv(desc=self.desc, is_slippery=self.is_slippery)
        state, _ = self._env.reset(seed=seed)  # seeds the slips too
        self.player = divmod(int(state), self.size)
        self.steps = 0
        self._subgoal = None
        self._live = True
        return self.observation()

    def step(self, action: str) -> StepResult:
        if not self._live:
            raise RuntimeError(f"{self.name}: step() needs a live episode; call reset(seed) first")
        key = normalize(action)
        self.steps += 1
        invalid = key not in _GYM_ACTION
        terminated, reward, feedback = False, 0.0, ""
        if invalid:
            reward = -self.invalid_penalty
            feedback = invalid_action_feedback(action, ACTIONS)
        else:
            state, r, terminated, _, _ = self.unwrapped.step(_GYM_ACTION[key])
            self.player = divmod(int(state), self.size)
            reward = float(r)
        done = bool(terminated) or self.steps >= self._max_steps
        subgoal_done = self._subgoal is not None and self.player == self._subgoal[1]
        if subgoal_done:
            self._subgoal = None  # so that subgoal_done is True on exactly one step
        self._live = not done
        return StepResult(
            observation=self.observation(),
            reward=reward,
            done=done,
            success=self.player == self.goal,
            subgoal_done=subgoal_done,
            invalid=invalid,
            feedback=feedback,
        )

    # ---- text ---------------------------------------------------------------------------

    def render(self) -> str:
        """The map, one row a line, cells separated by spaces; a legend; where the player is."""
        rows = [
            " ".join("P" if (r, c) == self.player else self.tile((r, c)) for c in range(self.size))
            for r in range(self.size)
        ]
        r, c = self.player
        here = self.tile(self.player)
        if here == "H":
            where = f"You fell into the hole at row {r} column {c}."
        elif here == "G":
            where = f"You reached the goal at row {r} column {c}."
        else:
            gr, gc = self.goal
            where = f"You are at row {r} column {c}; the goal is at row {gr} column {gc}."
        return "\n".join(rows + [LEGEND, where])

    def observation(self) -> Observation:
        """The current observation, recomputed from the env's state."""
        return Observation(MISSION, self.render(), list(ACTIONS), self._candidates())

    def reachable(self) -> set[Cell]:
        """Cells the player can walk to without entering a hole (the goal ends a walk)."""
        if self.tile(self.player) != "F":
            return set()
        seen, queue = {self.player}, deque([self.player])
        while queue:
            cell = queue.popleft()
            if self.tile(cell) == "G":
                continue
            for dr, dc in MOVES.values():
                nxt = (cell[0] + dr, cell[1] + dc)
                if self._inside(nxt) and nxt not in seen and self.tile(nxt) != "H":
                    seen.add(nxt)
                    queue.append(nxt)
        return seen

    def _inside(self, cell: Cell) -> bool:
        return 0 <= cell[0] < self.size and 0 <= cell[1] < self.size

    def _candidates(self) -> list[str]:
        """Nearby reachable ice in row-major order, then ``reach the goal``."""
        reach = self.reachable()
        if not reach:
            return []
        pr, pc = self.player
        near = sorted(
            c for c in reach
            if 0 < abs(c[0] - pr) + abs(c[1] - pc) <= SUBGOAL_RADIUS and self.tile(c) == "F"
        )
        return [f"go to row {r} column {c}" for r, c in near] + ["reach the goal"]

    # ---- subgoals -----------------------------------------------------------------------

    def _ground(self, text: str) -> tuple[str, Cell] | str:
        """The subgoal and its cell, or why it cannot be used.

        A cell where the player already stands is refused, so that naming what is already
        true earns no subgoal_done.
        """
        key = normalize(text)
        if key == "reach the goal":
            return key, self.goal
        match = _GO_TO.match(key)
        if not match:
            return f"cannot use subgoal {quote(text)}; use e.g. 'go to row 1 column 2' or 'reach the goal'"
        cell = (int(match[1]), int(match[2]))
        at = f"row {cell[0]} column {cell[1]}"
        if not self._inside(cell):
            return f"{at} is outside the {self.size}x{self.size} lake"
        if self.tile(cell) == "H":
            return f"{at} is a hole"
        if cell == self.player:
            return f"you are already at {at}"
        if cell not in self.reachable():
            return f"{at} cannot be reached without crossing a hole"
        return f"go to {at}", cell


# ---- expert ---------------------------------------------------------------------------------


def expert_policy(env: FrozenLakeTextEnv, gamma: float = 0.99) -> dict[Cell, str]:
    """Per cell, the action that maximises the discounted chance of reaching the goal.

    Value iteration on gymnasium's transition table, so it also plays the slippery lake well;
    ``gamma < 1`` makes it take a shortest path among equally safe ones. Ties go to the
    action listed first in ``ACTIONS``.
    """
    import numpy as np

    n = env.size * env.size
    future = np.zeros((n, 4, n))  # [S, A, S'] probability of a non-terminal next state
    reward = np.zeros((n, 4))  # [S, A] expected immediate reward
    for s, by_action in env.unwrapped.P.items():
        for a, outcomes in by_action.items():
            for prob, s2, r, terminal in outcomes:
                reward[s, a] += prob * r
                if not terminal:
                    future[s, a, s2] += prob
    value = np.zeros(n)  # [S]
    for _ in range(10_000):
        q = reward + gamma * future @ value  # [S, A]
        new = q.max(axis=1)
        if np.abs(new - value).max() < 1e-12:
            break
        value = new
    policy = {}
    for s in range(n):
        best = q[s].max()
        policy[divmod(s, env.size)] = next(w for w in ACTIONS if q[s, _GYM_ACTION[w]] >= best - 1e-12)
    return policy


def expert_path(env: FrozenLakeTextEnv) -> list[tuple[str, Cell]]:
    """A shortest safe path from the player to the goal, as (action, cell after) pairs.

    Needs a firm lake (``is_slippery=False``): on ice that slips, no plan is fixed ahead.
    """
    if env.is_slippery:
        raise ValueError("expert_path needs is_slippery=False; use expert_policy on slippery ice")
    policy, cell, path = expert_policy(env), env.player, []
    while env.tile(cell) == "F" and len(path) < env.size * env.size:
        word = policy[cell]
        cell = (cell[0] + MOVES[word][0], cell[1] + MOVES[word][1])
        path.append((word, cell))
    return path if env.tile(cell) == "G" else []


def expert_segments(env: FrozenLakeTextEnv) -> list[tuple[str, list[str]]]:
    """The expert's path as planner segments for the current state: ``go to`` waypoints
    ``EXPERT_LEG`` steps apart, then ``reach the goal``; each subgoal is done on its
    segment's last action (a shortest path never revisits a cell)."""
    path = expert_path(env)
    segments = []
    for start in range(0, len(path), EXPERT_LEG):
        leg = path[start : start + EXPERT_LEG]
        r, c = leg[-1][1]
        text = "reach the goal" if (r, c) == env.goal else f"go to row {r} column {c}"
        segments.append((text, [word for word, _ in leg]))
    return segments


def expert_episode(name: str, seed: int, max_steps: int | None = None, **kwargs: object) -> tuple[bool, int]:
    """Play one episode with ``expert_policy``; returns ``(success, length)``.

    ``kwargs`` go to the env (e.g. ``is_slippery=True``).
    """
    env = FrozenLakeTextEnv(name, max_steps=max_steps, **kwargs)  # type: ignore[arg-type]
    env.reset(seed)
    policy = expert_policy(env)
    length = 0
    while True:
        result = env.step(policy[env.player])
        length += 1
        if result.done:
            return result.success, length
