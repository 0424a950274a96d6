"""Sokoban as text, after RAGEN (arXiv:2504.20073), with gym-sokoban's rules and rewards.

Rooms are generated here (gym-sokoban needs the retired ``gym`` package): a random walk
carves a connected floor inside the walls, boxes start on their targets, and random reverse
moves (a step, or a step that pulls the box behind the player along) scramble them. A room
is thus solvable by construction; a breadth-first search over (player, boxes) then finds its
shortest solution, which is the expert and bounds the difficulty of accepted rooms.

Rewards follow gym-sokoban: ``-step_penalty`` (0.1) on every valid step, ``+box_reward`` (1)
for each box pushed onto a target and ``-box_reward`` for each pushed off one, and
``solve_bonus`` (10) on the step that puts the last box on a target, which ends the episode.
Rows and columns count from 0 at the top left, in the text and in subgoals alike.
"""

from __future__ import annotations

import random
import re
from collections import deque
from dataclasses import dataclass

from hieragent.envs.base import TextEnv, invalid_action_feedback, normalize, quote
from hieragent.types import Observation, StepResult

Cell = tuple[int, int]  # (row, column)

# The same four words as FrozenLake's, so one executor prompt serves both games.
ACTIONS = ["go up", "go down", "go left", "go right"]
MOVES: dict[str, Cell] = {"go up": (-1, 0), "go down": (1, 0), "go left": (0, -1), "go right": (0, 1)}


@dataclass(frozen=True)
class Spec:
    """A named room family: outer size (walls included), box count, default step cap."""

    rows: int
    cols: int
    boxes: int
    max_steps: int


SPECS = {
    "Sokoban-6x6-1box-v0": Spec(6, 6, 1, 30),
    "Sokoban-7x7-2box-v0": Spec(7, 7, 2, 60),
}
NAMES = list(SPECS)
MISSION = "push every box onto a target"
LEGEND = (
    "Legend: # wall, _ floor, O target, X box, * box on a target, P you, S you on a target; "
    "rows and columns count from 0 at the top left."
)
_CELL = r"row (\d{1,3}),? column (\d{1,3})"  # bounded: int() of 5000 digits raises
_PUT = re.compile(rf"^put a box on the target at {_CELL}$")
_PUSH = re.compile(rf"^push the box at {_CELL} (up|down|left|right)$")
_PULL_CHANCE = 0.8  # of a reverse step taking the box behind the player along
_ATTEMPTS = 1000
_DRAWS = 4  # acceptable rooms drawn per seed; the hardest is kept


def _add(cell: Cell, delta: Cell, k: int = 1) -> Cell:
    return cell[0] + k * delta[0], cell[1] + k * delta[1]


@dataclass(frozen=True)
class Room:
    """A Sokoban state. ``floor`` holds every cell that is not a wall, targets included."""

    rows: int
    cols: int
    floor: frozenset[Cell]
    targets: frozenset[Cell]
    boxes: frozenset[Cell]
    player: Cell

    def move(self, word: str) -> Room:
        """The room after the player tries ``word``; itself when a wall or a second box blocks."""
        delta = MOVES[word]
        ahead = _add(self.player, delta)
        if ahead not in self.floor:
            return self
        boxes = self.boxes
        if ahead in boxes:
            beyond = _add(ahead, delta)
            if beyond not in self.floor or beyond in boxes:
                return self
            boxes = (boxes - {ahead}) | {beyond}
        return Room(self.rows, self.cols, self.floor, self.targets, boxes, ahead)

    @property
    def solved(self) -> bool:
        return self.boxes == self.targets


def solve(room: Room, max_states: int = 200_000) -> list[str] | None:
    """A shortest action sequence that solves ``room`` (BFS over player and boxes), ``[]``
    if it is solved already, ``None`` if it cannot be solved or ``max_states`` ran out."""
    if room.solved:
        return []
    Key = tuple[Cell, frozenset[Cell]]
    parent: dict[Key, tuple[Key, str] | None] = {(room.player, room.boxes): None}
    queue = deque([room])
    while queue and len(parent) <= max_states:
        here = queue.popleft()
        for word in ACTIONS:
            nxt = here.move(word)
            key = (nxt.player, nxt.boxes)
            if key in parent:
                continue
            parent[key] = ((here.player, here.boxes), word)
            if nxt.solved:
                words, link = [], parent[key]
                while link is not None:
                    words.append(link[1])
                    link = parent[link[0]]
                return words[::-1]
            queue.append(nxt)
    return None


def generate_room(spec: Spec, seed: int) -> tuple[Room, list[str]]:
    """A scrambled room with no box on a target, and its shortest solution.

    Of ``_DRAWS`` acceptable rooms (solution at least two steps per box and at most half the
    default step cap, so a learner has slack) the one with the longest solution is kept:
    random reverse play alone mostly leaves the box a push or two from home.
    """
    rng = random.Random(seed)
    interior = (spec.rows - 2) * (spec.cols - 2)
    best: tuple[Room, list[str]] | None = None
    drawn = 0
    for _ in range(_ATTEMPTS):
        floor = _carve(spec, rng.randint(max(3 * spec.boxes + 2, interior // 2), interior * 9 // 10), rng)
        cells = sorted(floor)
        targets = frozenset(rng.sample(cells, spec.boxes))
        player = rng.choice([c for c in cells if c not in targets])
        start = Room(spec.rows, spec.cols, floor, targets, targets, player)
        room = _scramble(start, rng.randint(2 * interior, 4 * interior), rng)
        if room.boxes & room.targets:
            continue
        solution = solve(room)
        if solution is None or not 2 * spec.boxes <= len(solution) <= spec.max_steps // 2:
            continue
        if best is None or len(solution) > len(best[1]):
            best = room, solution
        drawn += 1
        if drawn == _DRAWS:
            return best
    raise RuntimeError(f"no acceptable Sokoban room in {_ATTEMPTS} draws for seed {seed}")


def _carve(spec: Spec, size: int, rng: random.Random) -> frozenset[Cell]:
    """``size`` connected floor cells, by a random walk that stays inside the outer wall."""
    pos = (rng.randint(1, spec.rows - 2), rng.randint(1, spec.cols - 2))
    floor = {pos}
    deltas = list(MOVES.values())
    while len(floor) < size:
        nxt = _add(pos, rng.choice(deltas))
        if 1 <= nxt[0] <= spec.rows - 2 and 1 <= nxt[1] <= spec.cols - 2:
            pos = nxt
            floor.add(pos)
    return frozenset(floor)


def _scramble(room: Room, steps: int, rng: random.Random) -> Room:
    """Random reverse moves from ``room``: each is undone by one forward move (a pull by a push)."""
    boxes, player = set(room.boxes), room.player
    deltas = list(MOVES.values())
    for _ in range(steps):
        delta = rng.choice(deltas)
        ahead, behind = _add(player, delta), _add(player, delta, -1)
        if ahead not in room.floor or ahead in boxes:
            continue
        if behind in boxes and rng.random() < _PULL_CHANCE:
            boxes.remove(behind)
            boxes.add(player)
        player = ahead
    return Room(room.rows, room.cols, room.floor, room.targets, frozenset(boxes), player)


class SokobanTextEnv(TextEnv):
    """A generated Sokoban room behind the ``TextEnv`` interface.

    Args:
        name: One of ``NAMES``; fixes the room's size and box count.
        max_steps: Step cap per episode; ``None``: 30 for one box in 6x6, 60 for two in 7x7
            (every accepted room's shortest solution takes at most half of that).
        invalid_penalty: Subtracted from the reward of an invalid action.
        step_penalty: Subtracted from the reward of every valid step (gym-sokoban: 0.1).
        box_reward: Added per box pushed onto a target, subtracted per box pushed off one.
        solve_bonus: Added when the last box reaches a target (gym-sokoban: 10).
    """

    world = "a Sokoban puzzle"

    def __init__(
        self,
        name: str,
        max_steps: int | None = None,
        invalid_penalty: float = 0.1,
        step_penalty: float = 0.1,
        box_reward: float = 1.0,
        solve_bonus: float = 10.0,
    ) -> None:
        super().__init__(invalid_penalty)
        if name not in SPECS:
            raise ValueError(f"unknown env {name!r}; known: {', '.join(NAMES)}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        self.name = name
        self.spec = SPECS[name]
        self.step_penalty, self.box_reward, self.solve_bonus = step_penalty, box_reward, solve_bonus
        self._max_steps = max_steps if max_steps is not None else self.spec.max_steps
        self.room: Room | None = None  # the current state
        self.steps = 0
        self._subgoal: tuple[str, str, Cell, str] | None = None  # text, "put" | "push", cell, direction
        self._live = False

    @property
    def max_steps(self) -> int:
        return self._max_steps

    @property
    def subgoal(self) -> str | None:
        """The current subgoal; cleared when set_subgoal fails or the subgoal is achieved."""
        return self._subgoal[0] if self._subgoal else None

    @property
    def state(self) -> Room:
        if self.room is None:
            raise RuntimeError(f"{self.name}: call reset(seed) first")
        return self.room

    def reset(self, seed: int) -> Observation:
        return self.reset_to(generate_room(self.spec, seed)[0])

    def reset_to(self, room: Room) -> Observation:
        """Start an episode from a given room (hand-made rooms in tests, fixed curricula)."""
        if len(room.boxes) != len(room.targets):
            n, m = len(room.boxes), len(room.targets)
            raise ValueError(f"a room needs as many boxes as targets, got {n} and {m}")
        self.room, self.steps, self._subgoal, self._live = room, 0, None, True
        return self.observation()

    def step(self, action: str) -> StepResult:
        if not self._live:
            raise RuntimeError(f"{self.name}: step() needs a live episode; call reset(seed) first")
        key = normalize(action)
        self.steps += 1
        before = self.state
        invalid = key not in MOVES
        feedback = ""
        if invalid:
            reward = -self.invalid_penalty
            feedback = invalid_action_feedback(action, ACTIONS)
        else:
            self.room = before.move(key)
            placed = len(self.room.boxes & self.room.targets) - len(before.boxes & before.targets)
            reward = -self.step_penalty + self.box_reward * placed
            reward += self.solve_bonus if self.room.solved else 0.0
        now = self.state
        done = now.solved or self.steps >= self._max_steps
        subgoal_done = False
        if self._subgoal is not None:
            _, verb, cell, direction = self._subgoal
            if verb == "put":
                subgoal_done = cell in now.boxes  # uncovered when set, so this is the arrival
            else:
                subgoal_done = cell in before.boxes - now.boxes and key == f"go {direction}"
        if subgoal_done:
            self._subgoal = None  # so that subgoal_done is True on exactly one step
        self._live = not done
        return StepResult(
            observation=self.observation(),
            reward=reward,
            done=done,
            success=now.solved,
            subgoal_done=subgoal_done,
            invalid=invalid,
            feedback=feedback,
        )

    # ---- text ---------------------------------------------------------------------------

    def render(self) -> str:
        """The room, one row a line, cells separated by spaces; a legend; a status line."""
        room = self.state

        def symbol(cell: Cell) -> str:
            on = cell in room.targets
            if cell not in room.floor:
                return "#"
            if cell == room.player:
                return "S" if on else "P"
            if cell in room.boxes:
                return "*" if on else "X"
            return "O" if on else "_"

        rows = [" ".join(symbol((r, c)) for c in range(room.cols)) for r in range(room.rows)]
        (r, c), placed = room.player, len(room.boxes & room.targets)
        where = f"You are at row {r} column {c}. Boxes on targets: {placed} of {len(room.boxes)}."
        return "\n".join(rows + [LEGEND, where])

    def observation(self) -> Observation:
        """The current observation, recomputed from the env's state."""
        return Observation(MISSION, self.render(), list(ACTIONS), self._candidates())

    def walkable(self) -> set[Cell]:
        """Cells the player reaches without pushing a box."""
        room = self.state
        seen, queue = {room.player}, deque([room.player])
        while queue:
            cell = queue.popleft()
            for delta in MOVES.values():
                nxt = _add(cell, delta)
                if nxt in room.floor and nxt not in room.boxes and nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
        return seen

    def _candidates(self) -> list[str]:
        """Uncovered targets, then the pushes the player can make now (walk there, push once)."""
        room, walk = self.state, self.walkable()
        put = [f"put a box on the target at row {r} column {c}" for r, c in sorted(room.targets - room.boxes)]
        push = []
        for box in sorted(room.boxes):
            for word, delta in MOVES.items():
                beyond, stand = _add(box, delta), _add(box, delta, -1)
                if beyond in room.floor and beyond not in room.boxes and stand in walk:
                    push.append(f"push the box at row {box[0]} column {box[1]} {word.removeprefix('go ')}")
        return put + push

    # ---- subgoals -----------------------------------------------------------------------

    def _ground(self, text: str) -> tuple[str, str, Cell, str] | str:
        """The subgoal as (text, verb, cell, direction), or why it cannot be used.

        Refused: a covered target (what is already true earns nothing) and a push a wall
        forbids forever. A push blocked for now (a box, no way round yet) is accepted.
        """
        room, key = self.state, normalize(text)
        put, push = _PUT.match(key), _PUSH.match(key)
        match = put or push
        if match is None:
            return (
                f"cannot use subgoal {quote(text)}; use e.g. 'put a box on the target at row 2 column 3' "
                "or 'push the box at row 2 column 2 left'"
            )
        cell = (int(match[1]), int(match[2]))
        at = f"row {cell[0]} column {cell[1]}"
        if not (0 <= cell[0] < room.rows and 0 <= cell[1] < room.cols):
            return f"{at} is outside the {room.rows}x{room.cols} room"
        if put:
            if cell not in room.targets:
                return f"there is no target at {at}"
            if cell in room.boxes:
                return f"the target at {at} already has a box on it"
            return f"put a box on the target at {at}", "put", cell, ""
        direction = match[3]
        if cell not in room.boxes:
            return f"there is no box at {at}"
        delta = MOVES[f"go {direction}"]
        if _add(cell, delta) not in room.floor or _add(cell, delta, -1) not in room.floor:
            return f"the box at {at} can never be pushed {direction}: a wall is in the way"
        return f"push the box at {at} {direction}", "push", cell, direction


# ---- expert ---------------------------------------------------------------------------------


def expert_segments(env: SokobanTextEnv) -> list[tuple[str, list[str]]]:
    """The shortest solution from the current state as planner segments.

    One ``put a box on the target`` segment per target, ending where that target is covered
    for the last time. When a target is covered at its segment's start, or covered in
    passing before that end, the segment is split (a ``push the box ... off`` subgoal, or a
    ``put`` that is done early), so that every subgoal is done exactly on its last action.
    """
    room = env.state
    solution = solve(room) or []
    states = [room]
    for word in solution:
        states.append(states[-1].move(word))

    def entered(k: int, t: Cell) -> bool:  # step k puts a box on target t
        return t not in states[k].boxes and t in states[k + 1].boxes

    last = {t: k for k in range(len(solution)) for t in room.targets if entered(k, t)}
    segments, s = [], 0
    for end, t in sorted((k, t) for t, k in last.items()):
        at = f"row {t[0]} column {t[1]}"
        while s <= end:
            if t in states[s].boxes:  # push it off first: the box stays until it is pushed
                u = next(k for k in range(s, end) if t in states[k].boxes and t not in states[k + 1].boxes)
                direction = solution[u].removeprefix("go ")
                segments.append((f"push the box at {at} {direction}", solution[s : u + 1]))
                s = u + 1
            else:
                j = next(k for k in range(s, end + 1) if entered(k, t))
                segments.append((f"put a box on the target at {at}", solution[s : j + 1]))
                s = j + 1
    return segments


def expert_episode(name: str, seed: int, max_steps: int | None = None, **kwargs: object) -> tuple[bool, int]:
    """Play the shortest solution for one episode; returns ``(success, length)``."""
    env = SokobanTextEnv(name, max_steps=max_steps, **kwargs)  # type: ignore[arg-type]
    env.reset(seed)
    for length, word in enumerate(solve(env.state) or [], start=1):
        result = env.step(word)
        if result.done:
            return result.success, length
    return False, 0
