"""BabyAI levels as text, in the style of BabyAI-Text (GLAM, arXiv:2302.02662) and BALROG.

The agent is described from its egocentric 7x7 view: minigrid's ``gen_obs_grid()`` puts the
agent at the bottom middle, facing "up", so a cell ``(i, j)`` of the view lies
``i - 3`` steps right (negative: left) and ``6 - j`` steps forward. Subgoal completion is
checked against the full grid, because the executor must be rewarded for what happened,
not for what it happens to see.
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hieragent.envs.base import TextEnv, check_env_name, invalid_action_feedback, normalize, quote
from hieragent.types import Observation, StepResult

if TYPE_CHECKING:
    from minigrid.core.world_object import WorldObj
    from minigrid.minigrid_env import MiniGridEnv

# Index i is minigrid's Actions(i): left, right, forward, pickup, drop, toggle.
ACTIONS = ["turn left", "turn right", "go forward", "pick up", "drop", "toggle"]
_ACTION_INDEX = {a: i for i, a in enumerate(ACTIONS)}
COLORS = ("red", "green", "blue", "purple", "yellow", "grey")
PICKABLE = ("ball", "box", "key")
OBJECT_TYPES = PICKABLE + ("door",)
_SUBGOAL = re.compile(r"^(go to|pick up|drop|open) (?:the|a) (\w+) (\w+)$")
_PUT_NEXT = re.compile(r"^put (?:the|a) (\w+) (\w+) next to (?:the|a) (\w+) (\w+)$")


@dataclass(frozen=True)
class Seen:
    """A visible non-wall object and where it is relative to the agent."""

    obj: WorldObj
    right: int  # [-3, 3], negative means left
    forward: int  # [0, 6]

    @property
    def distance(self) -> int:
        return abs(self.right) + self.forward


@dataclass
class _Subgoal:
    """A grounded subgoal; ``seen`` and ``doors`` snapshot what held when it was set."""

    text: str
    verb: str  # "go to" | "pick up" | "open" | "drop" | "put next" | "explore"
    color: str = ""
    type: str = ""
    near: tuple[str, str] = ("", "")  # put next: colour and type of the object to put it by
    seen: frozenset[int] = frozenset()  # explore: ids of objects visible or carried
    doors: list[WorldObj] = field(default_factory=list)  # open: doors closed at set time


def describe(obj: WorldObj) -> str:
    """``a red ball``; doors carry their state because it decides what the agent can do."""
    if obj.type == "door":
        if obj.is_open:
            return f"an open {obj.color} door"
        if obj.is_locked:
            return f"a locked {obj.color} door"
    return f"a {obj.color} {obj.type}"


def where(right: int, forward: int) -> str:
    """``1 step left and 2 steps forward``: sideways first, as in BabyAI-Text."""

    def steps(n: int, word: str) -> str:
        return f"{n} step{'s' if n != 1 else ''} {word}"

    parts = []
    if right:
        parts.append(steps(abs(right), "right" if right > 0 else "left"))
    if forward:
        parts.append(steps(forward, "forward"))
    return " and ".join(parts)


class BabyAITextEnv(TextEnv):
    """A BabyAI level (any ``BabyAI-*`` gymnasium id) behind the ``TextEnv`` interface.

    Args:
        level: Gymnasium id, e.g. ``BabyAI-GoToLocal-v0``.
        max_steps: Step cap per episode; ``None`` keeps the level's own cap (which BabyAI
            derives from the maze size and the mission at every reset).
        invalid_penalty: Subtracted from the reward of an invalid action.
    """

    world = "a grid world"  # keep: the README's BabyAI figures were measured with this prompt

    def __init__(self, level: str, max_steps: int | None = None, invalid_penalty: float = 0.1) -> None:
        super().__init__(invalid_penalty)
        check_env_name(level)
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        import gymnasium
        import minigrid  # noqa: F401  (registers the BabyAI ids)

        self.level = self.name = level
        self._max_steps = max_steps
        # The passive checker only warns about spaces BabyAI bends on purpose (missions).
        self._env = gymnasium.make(level, disable_env_checker=True)
        self._subgoal: _Subgoal | None = None
        self._live = False
        self._reset_raw(0)  # so that max_steps and unwrapped are defined before reset()

    @property
    def unwrapped(self) -> MiniGridEnv:
        """The minigrid env itself, for the expert bot and for tests."""
        return self._env.unwrapped  # type: ignore[return-value]

    @property
    def max_steps(self) -> int:
        return int(self.unwrapped.max_steps)

    @property
    def subgoal(self) -> str | None:
        """The current subgoal; cleared when set_subgoal fails or the subgoal is achieved."""
        return self._subgoal.text if self._subgoal else None

    def _reset_raw(self, seed: int) -> None:
        # BabyAI prints "Sampling rejected: ..." while it generates a level; keep logs clean.
        with contextlib.redirect_stdout(io.StringIO()):
            self._env.reset(seed=seed)
        if self._max_steps is not None:
            # RoomGridLevel.reset recomputes its cap, so the override goes in after it.
            self.unwrapped.max_steps = self._max_steps
        self._subgoal = None

    def reset(self, seed: int) -> Observation:
        self._reset_raw(seed)
        self._live = True
        return self.observation()

    def step(self, action: str) -> StepResult:
        if not self._live:
            raise RuntimeError(f"{self.level}: step() needs a live episode; call reset(seed) first")
        env = self.unwrapped
        index = _ACTION_INDEX.get(normalize(action))
        feedback = ""
        if index is None:
            # Mirror minigrid's own step accounting, without moving anything.
            env.step_count += 1
            reward, terminated = -self.invalid_penalty, False
            truncated = env.step_count >= env.max_steps
            feedback = invalid_action_feedback(action, ACTIONS)
        else:
            _, r, terminated, truncated, _ = self._env.step(index)
            reward = float(r)
        done = bool(terminated or truncated)
        view = self.view()
        subgoal_done = self._subgoal is not None and self._achieved(self._subgoal, view)
        if subgoal_done:
            self._subgoal = None  # so that subgoal_done is True on exactly one step
        self._live = not done
        return StepResult(
            observation=self._observation(view),
            reward=reward,
            done=done,
            success=bool(terminated and reward > 0),
            subgoal_done=subgoal_done,
            invalid=index is None,
            feedback=feedback,
        )

    # ---- perception -------------------------------------------------------------------

    def view(self) -> list[Seen]:
        """Visible non-wall objects, nearest first (ties by description, then position)."""
        grid, vis = self.unwrapped.gen_obs_grid()
        ax, ay = grid.width // 2, grid.height - 1
        seen = []
        for i in range(grid.width):
            for j in range(grid.height):
                obj = grid.get(i, j)
                # The agent's own cell holds what it carries; that is said separately.
                if obj is None or not vis[i, j] or (i, j) == (ax, ay) or obj.type == "wall":
                    continue
                seen.append(Seen(obj, i - ax, ay - j))
        seen.sort(key=lambda s: (s.distance, describe(s.obj), s.right, s.forward))
        return seen

    def _walls(self) -> list[str]:
        """The nearest visible wall straight forward, left and right (BabyAI-Text's choice)."""
        grid, vis = self.unwrapped.gen_obs_grid()
        ax, ay = grid.width // 2, grid.height - 1
        rays = (("forward", [(ax, ay - k) for k in range(1, ay + 1)]),
                ("left", [(ax - k, ay) for k in range(1, ax + 1)]),
                ("right", [(ax + k, ay) for k in range(1, grid.width - ax)]))
        clauses = []
        for word, cells in rays:
            for k, (i, j) in enumerate(cells, start=1):
                obj = grid.get(i, j)
                if not vis[i, j]:
                    break
                if obj is not None and obj.type == "wall":
                    clauses.append(f"a wall {k} step{'s' if k != 1 else ''} {word}")
                    break
        return clauses

    def observation(self) -> Observation:
        """The current observation, recomputed from the env's state."""
        return self._observation(self.view())

    def _observation(self, view: list[Seen]) -> Observation:
        env = self.unwrapped
        clauses = [f"{describe(s.obj)} {where(s.right, s.forward)}" for s in view] + self._walls()
        text = f"You see {', '.join(clauses)}." if clauses else "You see nothing."
        if env.carrying is not None:
            text += f" You carry {describe(env.carrying)}."
        return Observation(
            mission=str(env.mission), text=text, actions=list(ACTIONS), subgoals=self._candidates(view)
        )

    def _candidates(self, view: list[Seen]) -> list[str]:
        """Subgoals grounded in the view, grouped by verb; none that is already achieved."""
        env = self.unwrapped
        front = env.grid.get(*env.front_pos)
        facing = (front.color, front.type) if front is not None else None
        go = [f"go to the {s.obj.color} {s.obj.type}" for s in view if (s.obj.color, s.obj.type) != facing]
        held = env.carrying
        pick = [
            f"pick up the {s.obj.color} {s.obj.type}"
            for s in view
            if s.obj.type in PICKABLE and not (held and (held.color, held.type) == (s.obj.color, s.obj.type))
        ]
        doors = [f"open the {s.obj.color} door" for s in view if s.obj.type == "door" and not s.obj.is_open]
        drop = [f"drop the {held.color} {held.type}"] if held is not None else []
        put = [f"put the {held.color} {held.type} next to the {s.obj.color} {s.obj.type}"
               for s in view if held is not None and s.obj.type in PICKABLE]
        return list(dict.fromkeys(go + pick + doors + drop + put + ["explore"]))

    # ---- subgoals ---------------------------------------------------------------------

    def _ground(self, text: str) -> _Subgoal | str:
        """The subgoal, or why it cannot be used (unparseable, absent, or already done).

        Achieved-at-set-time subgoals are refused: otherwise a planner could collect
        subgoal_done for free by naming what is already true.
        """
        env = self.unwrapped
        key = normalize(text)
        if key == "explore":
            ids = {id(s.obj) for s in self.view()} | ({id(env.carrying)} if env.carrying else set())
            return _Subgoal(key, "explore", seen=frozenset(ids))
        put = _PUT_NEXT.match(key)
        if put:
            return self._ground_put_next(text, *put.groups())
        match = _SUBGOAL.match(key)
        if not match or match[2] not in COLORS or match[3] not in OBJECT_TYPES:
            return (
                f"cannot use subgoal {quote(text)}; use e.g. 'go to the red ball', "
                "'pick up the red ball', 'open the red door', 'drop the red ball', "
                "'put the red ball next to the blue key' or 'explore'"
            )
        verb, color, kind = match.groups()
        name = f"{color} {kind}"
        sg = _Subgoal(f"{verb} the {name}", verb, color, kind)
        objs = self._objects(color, kind)
        if verb == "drop":
            return sg if self._carries(color, kind) else f"you do not carry a {name}"
        if verb == "open":
            if kind != "door":
                return f"cannot open a {name}; only doors open"
            sg.doors = [o for o in objs if not o.is_open]
            if not objs:
                return f"there is no {name} here"
            return sg if sg.doors else f"the {name} is already open"
        if verb == "pick up" and kind not in PICKABLE:
            return f"cannot pick up a {name}"
        if verb == "pick up" and self._carries(color, kind):
            return f"you already carry the {name}"
        if not objs:
            return f"there is no {name} here"
        if verb == "go to" and self._facing(color, kind):
            return f"you are already at the {name}"
        return sg

    def _ground_put_next(self, text: str, color: str, kind: str, near_color: str,
                         near_kind: str) -> _Subgoal | str:
        if color not in COLORS or near_color not in COLORS or kind not in PICKABLE \
                or near_kind not in OBJECT_TYPES:
            return f"cannot use subgoal {quote(text)}; use e.g. 'put the red ball next to the blue key'"
        if not self._carries(color, kind):
            return f"you do not carry a {color} {kind}"
        if not self._objects(near_color, near_kind):
            return f"there is no {near_color} {near_kind} here"
        return _Subgoal(f"put the {color} {kind} next to the {near_color} {near_kind}", "put next",
                        color, kind, near=(near_color, near_kind))

    def _objects(self, color: str, kind: str) -> list[WorldObj]:
        return [o for o in self.unwrapped.grid.grid if o is not None and (o.color, o.type) == (color, kind)]

    def _cells(self, color: str, kind: str) -> list[tuple[int, int]]:
        """Grid positions of matching objects (read from the grid: ``cur_pos`` can be stale)."""
        grid = self.unwrapped.grid
        return [(x, y) for x in range(grid.width) for y in range(grid.height)
                if (o := grid.get(x, y)) is not None and (o.color, o.type) == (color, kind)]

    def _carries(self, color: str, kind: str) -> bool:
        held = self.unwrapped.carrying
        return held is not None and (held.color, held.type) == (color, kind)

    def _facing(self, color: str, kind: str) -> bool:
        """BabyAI's GoTo success rule: the object is in the cell right in front."""
        front = self.unwrapped.grid.get(*self.unwrapped.front_pos)
        return front is not None and (front.color, front.type) == (color, kind)

    def _achieved(self, sg: _Subgoal, view: list[Seen]) -> bool:
        if sg.verb == "go to":
            return self._facing(sg.color, sg.type)
        if sg.verb == "pick up":
            return self._carries(sg.color, sg.type)
        if sg.verb == "drop":
            return not self._carries(sg.color, sg.type)
        if sg.verb == "open":
            return any(d.is_open for d in sg.doors)
        if sg.verb == "put next":  # BabyAI's PutNext rule: dropped, and 4-adjacent to the other
            if self._carries(sg.color, sg.type):
                return False
            return any(abs(ax - bx) + abs(ay - by) == 1 for ax, ay in self._cells(sg.color, sg.type)
                       for bx, by in self._cells(*sg.near))
        return any(id(s.obj) not in sg.seen for s in view)  # explore
