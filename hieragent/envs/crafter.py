"""Crafter as text (Hafner, arXiv:2109.06780), rendered the way BALROG (arXiv:2411.13543) does.

A seed fixes the episode: ``reset(seed)`` plays a fresh ``crafter.Env(seed=seed)`` (crafter
derives a world from its seed and a count of its resets, so one env per seed), generated
once and copied for later resets to the same seed (``cache_worlds``). crafter picks which
creature to despawn from a set that iterates in memory-address order, so the same seed could
play out differently from run to run; the env makes those sets iterate in a fixed order.

The 17 actions are crafter's names with spaces (``move left``, ``place table``, ``make wood
pickaxe``), matched after ``normalize`` (underscores are read as spaces); anything else is
an invalid step, which does not move the world (nor its clock). While the player sleeps,
crafter turns every action into sleep until energy is full or the player is hurt.

The text is read from the world's semantic map, over the 9x7 cells the image shows around
the player: the nearest cell of each kind in view with its offset ("tree: 2 steps up and 1
right", ordered by distance), what the player faces, the inventory, the status (health,
food, drink, energy out of 9), day or night, and whether the player sleeps. Up is north, as
in the image. A ripe plant (one that can be eaten) is shown as ``ripe plant``.

Reward is crafter's own: +1 on the step that first unlocks an achievement, +-0.1 per point of
health gained or lost; an invalid step earns ``-invalid_penalty`` instead. The episode ends
on death or at ``max_steps`` (500 by default, about one and a half day-night cycles of 300
steps, a length a text agent can train on; crafter's own is 10000, the paper's protocol:
pass ``max_steps=10000`` to measure that).

Crafter has no success of its own. Here ``success`` says whether this episode has unlocked
``success_achievement`` (``make wood pickaxe`` by default; ``None``: never), and stays True
from that step on; the mission names it. Tables should report ``crafter_score`` over the
unlock rates of ``env.achievements`` instead (the paper's score).

Subgoals are the 22 achievements by name ("collect wood", "place table", ...). Any of them
can be set; it is done on the step that raises its count. The planner is offered the ones
not yet unlocked, and those worth repeating (all but the tools and the diamond).

No expert exists for Crafter: ``hieragent.envs.crafter_scripted`` holds a rule-based
baseline for the tables' reference row.

crafter has no public API for its state, so this module reads its player and world
(``Env._player``, ``Env._world``), which is why ``pyproject.toml`` pins crafter to 1.8.
"""

from __future__ import annotations

import collections
import copy
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hieragent.envs.base import TextEnv, invalid_action_feedback, normalize, quote
from hieragent.types import Observation, StepResult

if TYPE_CHECKING:
    import crafter

NAMES = ["Crafter-v0"]
# crafter's action order (its action ids), with spaces for underscores.
ACTIONS = [
    "noop", "move left", "move right", "move up", "move down", "do", "sleep", "place stone",
    "place table", "place furnace", "place plant", "make wood pickaxe", "make stone pickaxe",
    "make iron pickaxe", "make wood sword", "make stone sword", "make iron sword",
]
_ACTION_ID = {word: i for i, word in enumerate(ACTIONS)}
# The 22 achievements, ordered roughly by the tech tree (crafter lists them alphabetically).
ACHIEVEMENTS = [
    "collect wood", "place table", "make wood pickaxe", "make wood sword", "collect sapling",
    "place plant", "eat plant", "collect drink", "eat cow", "wake up", "defeat zombie",
    "defeat skeleton", "collect stone", "place stone", "make stone pickaxe", "make stone sword",
    "place furnace", "collect coal", "collect iron", "make iron pickaxe", "make iron sword",
    "collect diamond",
]
# Dropped from the planner's candidates once unlocked: tools never wear out.
ONCE = {"make wood pickaxe", "make wood sword", "make stone pickaxe", "make stone sword",
        "make iron pickaxe", "make iron sword", "collect diamond"}
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}  # (x, y), y down
VIEW = (9, 7)  # cells shown around the player, as crafter's image: 9 wide, 7 high
DEFAULT_MAX_STEPS = 500
VITALS = ("health", "food", "drink", "energy")


def spaced(name: str) -> str:
    return name.replace("_", " ")


def crafter_score(success_rates: Mapping[str, float] | Sequence[float]) -> float:
    """The Crafter score (Hafner 2021, eq. 1): ``exp(mean_i ln(1 + s_i)) - 1``.

    ``success_rates`` holds each achievement's unlock rate in percent (0-100) over episodes:
    22 numbers, or a mapping from the 22 names in ``ACHIEVEMENTS`` (missing names count 0).
    """
    rates = _rates(success_rates)
    return math.exp(math.fsum(math.log1p(s) for s in rates) / len(rates)) - 1.0


def balrog_progression(success_rates: Mapping[str, float] | Sequence[float]) -> float:
    """BALROG's Crafter metric (Paglieri et al. 2024): the share of the 22 achievements an
    episode unlocks, in percent, averaged over episodes. That mean equals the mean of the
    achievements' unlock rates, which is what this takes (as ``crafter_score`` does)."""
    rates = _rates(success_rates)
    return math.fsum(rates) / len(rates)


def _rates(success_rates: Mapping[str, float] | Sequence[float]) -> list[float]:
    """The 22 unlock rates in ``ACHIEVEMENTS`` order, checked."""
    if isinstance(success_rates, Mapping):
        unknown = set(success_rates) - set(ACHIEVEMENTS)
        if unknown:
            raise ValueError(f"success_rates: unknown achievements {sorted(unknown)}; known: {ACHIEVEMENTS}")
        rates = [float(success_rates.get(a, 0.0)) for a in ACHIEVEMENTS]
    else:
        rates = [float(s) for s in success_rates]
    if len(rates) != len(ACHIEVEMENTS) or not all(0.0 <= s <= 100.0 for s in rates):
        raise ValueError(f"success_rates: expected 22 percentages in [0, 100], got {rates}")
    return rates


class CrafterTextEnv(TextEnv):
    """``crafter.Env`` behind the ``TextEnv`` interface.

    Args:
        name: ``"Crafter-v0"``.
        max_steps: Step cap per episode (invalid steps count); ``None``: 500.
        invalid_penalty: Subtracted from the reward of an invalid action.
        success_achievement: The achievement whose unlock is ``success``; ``None``: none.
        cache_worlds: Freshly generated worlds kept, by seed, so that resetting to a recent
            seed again (a GRPO group) copies one (about 1 ms) instead of generating it (about
            1 s). ``0`` keeps none.
    """

    world = "a Crafter survival world"

    def __init__(self, name: str, max_steps: int | None = None, invalid_penalty: float = 0.1,
                 success_achievement: str | None = "make wood pickaxe", cache_worlds: int = 8) -> None:
        super().__init__(invalid_penalty)
        if name not in NAMES:
            raise ValueError(f"unknown env {name!r}; known: {', '.join(NAMES)}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        if cache_worlds < 0:
            raise ValueError(f"cache_worlds must be >= 0, got {cache_worlds}")
        if success_achievement is not None and success_achievement not in ACHIEVEMENTS:
            raise ValueError(f"success_achievement must be None or one of {', '.join(ACHIEVEMENTS)}; "
                             f"got {success_achievement!r}")
        self.name = name
        self.success_achievement = success_achievement
        self._max_steps = max_steps if max_steps is not None else DEFAULT_MAX_STEPS
        self.seed: int | None = None
        self.steps = 0
        self._env: crafter.Env | None = None
        self._subgoal: tuple[str] | None = None
        self._live = False
        self.cache_worlds = cache_worlds
        self._fresh: dict[int, crafter.Env] = {}  # seed -> its world just generated, oldest first

    @property
    def max_steps(self) -> int:
        return self._max_steps

    @property
    def unwrapped(self) -> crafter.Env:
        if self._env is None:
            raise RuntimeError(f"{self.name}: call reset(seed) first")
        return self._env

    @property
    def player(self) -> Any:
        """crafter's player object (position, facing, inventory, achievement counts)."""
        return self.unwrapped._player

    @property
    def subgoal(self) -> str | None:
        """The current subgoal, an achievement; cleared when it is done or set_subgoal fails."""
        return self._subgoal[0] if self._subgoal else None

    @property
    def achievements(self) -> dict[str, int]:
        """How often this episode has earned each of the 22 achievements so far."""
        counts = self.player.achievements
        return {a: counts[a.replace(" ", "_")] for a in ACHIEVEMENTS}

    @property
    def unlocked(self) -> set[str]:
        return {a for a, n in self.achievements.items() if n > 0}

    @property
    def inventory(self) -> dict[str, int]:
        return {spaced(k): v for k, v in self.player.inventory.items()}

    @property
    def mission(self) -> str:
        text = "survive, collect resources and craft tools to unlock as many achievements as you can"
        return text + (f"; success is to {self.success_achievement}" if self.success_achievement else "")

    def reset(self, seed: int) -> Observation:
        fresh = self._fresh.get(seed)
        if fresh is None:
            fresh = _fresh_world(seed)
        if self.cache_worlds:
            self._fresh[seed] = fresh
            if len(self._fresh) > self.cache_worlds:
                self._fresh.pop(next(iter(self._fresh)))
        self._env = copy.deepcopy(fresh, {id(fresh._textures): fresh._textures})  # textures are read-only
        self.seed, self.steps, self._subgoal, self._live = seed, 0, None, True
        return self.observation()

    def step(self, action: str) -> StepResult:
        if not self._live:
            raise RuntimeError(f"{self.name}: step() needs a live episode; call reset(seed) first")
        key = normalize(action).replace("_", " ")
        self.steps += 1
        invalid = key not in _ACTION_ID
        dead, subgoal_done, feedback = False, False, ""
        if invalid:
            reward, feedback = -self.invalid_penalty, invalid_action_feedback(action, ACTIONS)
        else:
            before = self.achievements
            _, reward, dead, _ = self.unwrapped.step(_ACTION_ID[key])
            after = self.achievements
            if self._subgoal is not None and after[self._subgoal[0]] > before[self._subgoal[0]]:
                subgoal_done, self._subgoal = True, None  # True on exactly one step
        done = bool(dead) or self.steps >= self._max_steps
        self._live = not done
        return StepResult(observation=self.observation(), reward=float(reward), done=done,
                          success=self.success_achievement in self.unlocked, subgoal_done=subgoal_done,
                          invalid=invalid, feedback=feedback)

    # ---- text ---------------------------------------------------------------------------

    def local_view(self) -> dict[tuple[int, int], str]:
        """What is in each cell in view, by its offset ``(right, down)`` from the player (who
        is left out): a creature or plant if one stands there, else the material."""
        world, (px, py) = self.unwrapped._world, self.player.pos
        view = {}
        for dx in range(-(VIEW[0] // 2), VIEW[0] // 2 + 1):
            for dy in range(-(VIEW[1] // 2), VIEW[1] // 2 + 1):
                material, obj = world[(px + dx, py + dy)]
                if material is None or (dx, dy) == (0, 0):
                    continue  # outside the world
                view[(dx, dy)] = material if obj is None else _object_name(obj)
        return view

    def render(self) -> str:
        view, player = self.local_view(), self.player
        nearest: dict[str, tuple[int, int]] = {}
        for (dx, dy), kind in sorted(view.items(), key=lambda kv: (abs(kv[0][0]) + abs(kv[0][1]), kv[0])):
            nearest.setdefault(kind, (dx, dy))
        seen = sorted(nearest.items(), key=lambda kv: (abs(kv[1][0]) + abs(kv[1][1]), kv[0]))
        lines = ["You see:"] + [f"- {kind}: {_offset_text(dx, dy)}" for kind, (dx, dy) in seen]
        facing = tuple(int(v) for v in player.facing)
        word = next(w for w, d in DIRECTIONS.items() if d == facing)
        lines.append(f"You face {view.get(facing, 'the edge of the world')} ({word}).")
        items = [f"{spaced(k)} {v}" for k, v in player.inventory.items() if k not in VITALS and v > 0]
        lines.append(f"Inventory: {', '.join(items) if items else 'nothing'}.")
        lines.append(", ".join(f"{k} {player.inventory[k]}/9" for k in VITALS).capitalize() + ".")
        daylight = self.unwrapped._world.daylight
        lines.append(("It is day." if daylight >= 0.5 else "It is night.")
                     + (" You are asleep." if player.sleeping else ""))
        return "\n".join(lines)

    def observation(self) -> Observation:
        unlocked = self.unlocked
        subgoals = [a for a in ACHIEVEMENTS if a not in unlocked or a not in ONCE]
        return Observation(self.mission, self.render(), list(ACTIONS), subgoals)

    # ---- subgoals -----------------------------------------------------------------------

    def _ground(self, text: str) -> tuple[str] | str:
        """``(achievement,)``, or why ``text`` names none."""
        key = normalize(text).replace("_", " ")
        if key in ACHIEVEMENTS:
            return (key,)
        return f"cannot use subgoal {quote(text)}; subgoals are achievements: {', '.join(ACHIEVEMENTS)}"


class _OrderedSet(dict):
    """The few set methods crafter's world calls on a chunk's objects, iterated in insertion
    order: crafter's sets iterate in memory-address order, and picking which creature to
    despawn from one made the same seed play out differently from run to run."""

    def add(self, item: object) -> None:
        self[item] = None

    def remove(self, item: object) -> None:
        del self[item]


def _fresh_world(seed: int) -> crafter.Env:
    """``crafter.Env(seed=seed)`` just reset, its chunks made ordered (``_OrderedSet``)."""
    import crafter

    env = crafter.Env(seed=seed, length=None)  # None: the episode's end is ours (max_steps)
    env.reset()
    world = env._world
    world._chunks = collections.defaultdict(_OrderedSet, {  # objects by position, then as added
        key: _OrderedSet.fromkeys(sorted(objs, key=lambda o: (int(o.pos[0]), int(o.pos[1]))))
        for key, objs in world._chunks.items()})
    return env


def _object_name(obj: Any) -> str:
    name = type(obj).__name__.lower()
    return "ripe plant" if name == "plant" and obj.ripe else name


def _offset_text(dx: int, dy: int) -> str:
    """``2 steps up and 1 right``: the vertical part first, then the horizontal one."""
    parts = [(abs(dy), "up" if dy < 0 else "down"), (abs(dx), "left" if dx < 0 else "right")]
    parts = [(n, w) for n, w in parts if n]
    first = f"{parts[0][0]} step{'s' if parts[0][0] > 1 else ''} {parts[0][1]}"
    return first + (f" and {parts[1][0]} {parts[1][1]}" if len(parts) > 1 else "")
