"""The scripted Crafter baseline: the reference row of Crafter's tables, since no expert exists.

``ScriptedPlayer`` is a rule-based baseline that reads what the text shows (the local view,
the inventory, the vitals), crafter's daylight level, and a memory of where it saw water, cows
and materials. It fights what stands next to it; drinks when thirsty and eats cows when hungry
(earlier as night falls); at dusk or when tired it walls itself in (a pocket of free ground
that one stone closes, or a two-cell tunnel it digs into rock) and sleeps; otherwise it climbs
the tech tree (wood, table, wood tools, stone, stone tools, furnace, coal, iron, iron tools,
diamond), collecting a sapling and placing a plant and a stone on the way. It walks by
breadth-first search in view, towards a remembered cell, or in a seeded random heading.
``expert_segments`` cuts its play at every step that raises an achievement's count; ``python
-m hieragent.envs.crafter_scripted --episodes 20`` prints its unlock rates, Crafter score and
BALROG's progression on held-out seeds.
"""

from __future__ import annotations

import argparse
import collections
import random
from collections.abc import Iterator
from typing import Any

from hieragent.envs.base import EVAL_SEED_OFFSET
from hieragent.envs.crafter import (
    ACHIEVEMENTS, DEFAULT_MAX_STEPS, DIRECTIONS, NAMES, VIEW, CrafterTextEnv, spaced, balrog_progression,
    crafter_score,
)
from hieragent.types import StepResult

Offset = tuple[int, int]  # (right, down) from the player
WALKABLE = {"grass", "sand", "path"}  # lava too, for crafter, but it kills
CREATURES = {"cow", "zombie", "skeleton", "arrow", "plant", "ripe plant"}
SOLID = {"stone", "coal", "iron", "diamond", "tree", "water", "lava", "table", "furnace"}
DIGGABLE = WALKABLE | {"stone", "coal"}  # a wood pickaxe mines these
STONE_STOCK = 3  # stones the baseline keeps at hand to wall itself in for the night
DUSK = 0.6  # daylight below which it shelters: zombies spawn more as light falls
MEMORY = ("water", "cow", "tree", "stone", "coal", "iron", "diamond")  # remembered by position
# What the baseline crafts, in order; each is made once (tools never wear out).
TECH = ["wood_pickaxe", "wood_sword", "stone_pickaxe", "stone_sword", "furnace", "iron_pickaxe", "iron_sword"]


class ScriptedPlayer:
    """The rule-based Crafter baseline (see the module docstring); ``act`` gives one action.

    It reads the env's local view and the player's inventory only, and draws its random
    exploration headings from ``random.Random(seed)``, so an episode is a function of the seed.
    """

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.heading = self.rng.choice(list(DIRECTIONS.values()))
        self.thirsty = self.hungry = False
        self.sapling_tries = 0
        self.memory: dict[str, set[tuple[int, int]]] = {kind: set() for kind in MEMORY}

    def act(self, env: CrafterTextEnv) -> str:
        from crafter import constants

        player, view = env.player, env.local_view()
        view[(0, 0)] = env.unwrapped._world[player.pos][0]  # the ground the player stands on
        inv, done = player.inventory, env.unlocked
        ahead = view.get(tuple(int(v) for v in player.facing))
        if player.sleeping:
            return "noop"
        for word, d in DIRECTIONS.items():  # fight whatever stands next to us
            if view.get(d) in ("zombie", "skeleton"):
                return "do" if _facing(player) == d else f"move {word}"  # a move into it turns
        evening = env.unwrapped._world.daylight < DUSK + 0.2 and not _enclosed(view)  # stock up first
        self.thirsty = inv["drink"] <= (6 if evening else 4) or (self.thirsty and inv["drink"] < 9)
        self.hungry = inv["food"] <= (5 if evening else 4) or (self.hungry and inv["food"] < 8)
        self._remember(player, view)
        night = env.unwrapped._world.daylight < DUSK
        if night or inv["energy"] <= 2:  # sleep walled in, where zombies cannot reach
            if _enclosed(view):
                return "sleep" if inv["energy"] < 9 else "noop"
            action = self._shelter(player, view) if inv["stone"] > 0 else None
            if not action and inv["wood_pickaxe"]:
                action = self._tunnel(player, view)
            if action:
                return action
        if ahead == "water" and inv["drink"] < 9:
            return "do"
        for wanted, kinds in ((self.thirsty, {"water"}), (self.hungry, {"cow"}), (True, {"ripe plant"})):
            action = self._reach(player, view, kinds, "do") if wanted else None
            if action:
                return action
        if "place stone" not in done and inv["stone"] > 0 and ahead in constants.place["stone"]["where"]:
            return "place stone"
        if inv["sapling"] > 0 and ahead == "grass" and "place plant" not in done:
            return "place plant"
        if "collect sapling" not in done and ahead == "grass" and self.sapling_tries < 20:
            self.sapling_tries += 1
            return "do"
        for tool in TECH:
            if (inv[tool] == 0) if tool != "furnace" else ("place furnace" not in done):
                action = self._make(player, view, inv, tool, constants)
                if action:
                    return action
                break
        else:
            action = self._reach(player, view, {"diamond"}, "do")
            if action:
                return action
        if inv["wood_pickaxe"] and inv["stone"] < STONE_STOCK:  # walls for the night
            action = self._reach(player, view, {"stone"}, "do")
            if action:
                return action
        return self._explore(view)

    # ---- goals ----

    def _make(self, player, view, inv, tool, constants) -> str | None:
        """The next action towards making ``tool`` (or placing a ``furnace`` next to a table):
        gather, place stations, walk, make."""
        recipe = constants.make[tool] if tool != "furnace" else {"uses": {}, "nearby": ["table", "furnace"]}
        need = dict(recipe["uses"])
        stations = [s for s in recipe["nearby"] if s not in view.values()]
        for station in stations:
            for item, n in constants.place[station]["uses"].items():
                need[item] = need.get(item, 0) + n
        missing = [m for m, n in need.items() if inv[m] < n]
        for material in missing:  # any one in view first, then explore
            source = {m for m, info in constants.collect.items() if material in info["receive"]}
            action = self._reach(player, view, source, "do")
            if action:
                return action
        if missing:
            return None
        if stations:  # place the first missing one next to the others, facing free ground
            if any(s in view.values() for s in recipe["nearby"]) and not _near(view, (0, 0), recipe["nearby"],
                                                                               but=stations[0]):
                return self._walk(view, lambda c: _near(view, c, recipe["nearby"], but=stations[0]))
            return self._place(player, view, stations[0], constants)
        if _near(view, (0, 0), recipe["nearby"]):
            return "make " + spaced(tool)
        return self._walk(view, lambda c: _near(view, c, recipe["nearby"]))

    def _place(self, player, view, kind, constants) -> str:
        where = constants.place[kind]["where"]
        facing = _facing(player)
        if view.get(facing) in where:
            return f"place {kind}"
        for word, (dx, dy) in DIRECTIONS.items():  # step so that free ground lies ahead
            if view.get((dx, dy)) in WALKABLE and view.get((2 * dx, 2 * dy)) in where:
                return f"move {word}"
        return self._explore(view)

    def _shelter(self, player, view) -> str | None:
        """Towards a spot that one stone closes: a small pocket of free ground whose only
        way out is the cell ahead of whoever walks in by its back cell."""
        facing = _facing(player)
        if view.get(facing) in WALKABLE and _enclosed(view, also_blocked=facing):
            return "place stone"
        paths, best = _bfs(view), None
        for x in paths:
            for word, d in DIRECTIONS.items():
                gate, back = _add(x, d), (x[0] - d[0], x[1] - d[1])
                if view.get(gate) in WALKABLE and back in paths and _enclosed(view, x, gate):
                    if best is None or len(paths[back]) < len(paths[best[0]]):
                        best = (back, word)
        if best is None:
            return None
        back, word = best
        return f"move {paths[back][0]}" if paths[back] else f"move {word}"

    def _tunnel(self, player, view) -> str | None:
        """Towards a two-cell tunnel dug into rock: cells ``a`` then ``b`` in a line from free
        ground ``gate``, walled on their sides and beyond ``b``, mined where still stone;
        ``_shelter`` then closes the gate."""
        paths, best = _bfs(view), None
        for gate in paths:
            for word, d in DIRECTIONS.items():
                a, b = _add(gate, d), _add(gate, (2 * d[0], 2 * d[1]))
                side = (d[1], d[0])
                walls = [_add(b, d)] + [_add(c, (k * side[0], k * side[1])) for c in (a, b) for k in (1, -1)]
                if (view.get(a) in DIGGABLE and view.get(b) in DIGGABLE and all(view.get(w) in SOLID for w in walls)
                        and (best is None or len(paths[gate]) < len(paths[best[0]]))):
                    best = (gate, word, a, b)
        if best is None:
            return None
        gate, word, a, _ = best
        stand = gate if view.get(a) not in WALKABLE else a  # next to the first rock in line
        if paths[stand]:
            return f"move {paths[stand][0]}"
        return "do" if _facing(player) == DIRECTIONS[word] else f"move {word}"  # a move into rock turns

    # ---- walking ----

    def _remember(self, player, view) -> None:
        """Where each kind in ``MEMORY`` was last seen, in world coordinates."""
        px, py = int(player.pos[0]), int(player.pos[1])
        for (dx, dy), kind in view.items():
            for k, cells in self.memory.items():
                (cells.add if kind == k else cells.discard)((px + dx, py + dy))

    def _reach(self, player, view, kinds, final) -> str | None:
        """Walk next to the nearest cell of ``kinds``, face it and act; None if none is reachable
        in view. With none in view, head for the nearest one remembered."""
        for word, d in DIRECTIONS.items():
            if view.get(d) in kinds:
                return final if _facing(player) == d else f"move {word}"
        action = self._walk(view, lambda c: any(view.get(_add(c, d)) in kinds for d in DIRECTIONS.values()))
        if action or any(k in view.values() for k in kinds):
            return action
        px, py = int(player.pos[0]), int(player.pos[1])
        known = [c for k in kinds for c in self.memory.get(k, ())]
        if not known:
            return None
        tx, ty = min(known, key=lambda c: (abs(c[0] - px) + abs(c[1] - py), c))
        paths = _bfs(view)
        best = min(paths, key=lambda c: (abs(px + c[0] - tx) + abs(py + c[1] - ty), len(paths[c]), c))
        if not paths[best]:  # no way closer in view: forget it
            for k in kinds:
                self.memory.get(k, set()).discard((tx, ty))
            return None
        return f"move {paths[best][0]}"

    def _walk(self, view, goal) -> str | None:
        """The first move of a shortest walk over free ground to a cell where ``goal`` holds."""
        path = _bfs(view)
        best = min((c for c in path if goal(c)), key=lambda c: (len(path[c]), c), default=None)
        if best is None:
            return None
        return f"move {path[best][0]}" if path[best] else None

    def _explore(self, view) -> str:
        """Walk towards the far side of the view along ``heading``; turn when blocked."""
        path = _bfs(view)
        for _ in range(4):
            hx, hy = self.heading
            far = max(path, key=lambda c: (c[0] * hx + c[1] * hy, -len(path[c]), c))
            if far[0] * hx + far[1] * hy > 0 and self.rng.random() > 0.02:
                return f"move {path[far][0]}"
            self.heading = self.rng.choice([d for d in DIRECTIONS.values() if d != self.heading])
        return "do"  # walled in: dig or hit what is ahead


def _add(a: Offset, b: Offset) -> Offset:
    return a[0] + b[0], a[1] + b[1]


def _facing(player: Any) -> Offset:
    return int(player.facing[0]), int(player.facing[1])


def _near(view: dict[Offset, str], cell: Offset, stations: list[str], but: str | None = None) -> bool:
    """Whether every station (except ``but``) is within the 3x3 square around ``cell``."""
    around = {view.get(_add(cell, (dx, dy))) for dx in (-1, 0, 1) for dy in (-1, 0, 1)}
    return all(s in around for s in stations if s != but)


def _bfs(view: dict[Offset, str], start: Offset = (0, 0), blocked: Offset | None = None,
         limit: int | None = None, free: set[str] = WALKABLE) -> dict[Offset, list[str]]:
    """Cells reachable from ``start`` over ``free`` cells in view (not through ``blocked``),
    with the moves that reach them; at most ``limit`` cells."""
    paths: dict[Offset, list[str]] = {start: []}
    queue = collections.deque([start])
    while queue and (limit is None or len(paths) <= limit):
        cell = queue.popleft()
        for word, d in DIRECTIONS.items():
            nxt = _add(cell, d)
            if nxt not in paths and nxt != blocked and view.get(nxt) in free:
                paths[nxt] = paths[cell] + [word]
                queue.append(nxt)
    return paths


def _enclosed(view: dict[Offset, str], start: Offset = (0, 0), also_blocked: Offset | None = None) -> bool:
    """Whether free ground from ``start`` is a pocket of at most 3 cells, away from the view's
    edge (beyond which it could be open). Creatures do not count as walls: they move."""
    pocket = _bfs(view, start, also_blocked, limit=3, free=WALKABLE | CREATURES)
    return len(pocket) <= 3 and all(abs(x) < VIEW[0] // 2 and abs(y) < VIEW[1] // 2 for x, y in pocket)


def scripted_steps(env: CrafterTextEnv, stop_at_success: bool = False) -> Iterator[tuple[str, StepResult]]:
    """The baseline's ``(action, result)`` on ``env`` (just reset), one step at a time, to
    the episode's end or to its success."""
    player = ScriptedPlayer(env.seed or 0)
    while True:
        action = player.act(env)
        result = env.step(action)
        yield action, result
        if result.done or (stop_at_success and result.success):
            return


def play_scripted(env: CrafterTextEnv, stop_at_success: bool = False) -> list[tuple[str, StepResult]]:
    """``scripted_steps`` played out."""
    return list(scripted_steps(env, stop_at_success))


def expert_segments(env: CrafterTextEnv) -> list[tuple[str, list[str]]]:
    """The baseline's episode cut after every step that raises an achievement's count, each
    segment's subgoal being that achievement (the first in ``ACHIEVEMENTS`` order if one step
    raises two); the play after the last such step is dropped. ``[]`` when the episode does
    not reach ``success`` (demos must succeed)."""
    counts = env.achievements
    segments, actions = [], []
    for action, _ in scripted_steps(env):
        actions.append(action)
        now = env.achievements
        raised = [a for a in ACHIEVEMENTS if now[a] > counts[a]]
        counts = now
        if raised:
            segments.append((raised[0], actions))
            actions = []
    return segments if env.success_achievement in env.unlocked else []


def expert_episode(name: str, seed: int, max_steps: int | None = None, **kwargs: Any) -> tuple[bool, int]:
    """Play the baseline until ``success`` or the episode's end; ``(success, length)``."""
    env = CrafterTextEnv(name, max_steps=max_steps, **kwargs)
    env.reset(seed)
    played = play_scripted(env, stop_at_success=True)
    return played[-1][1].success, len(played)


def measure(episodes: int, first_seed: int = EVAL_SEED_OFFSET, max_steps: int | None = None) -> dict[str, float]:
    """The baseline's unlock rate of each achievement, in percent, over ``episodes`` seeds."""
    from rich.progress import Progress

    env, hits = CrafterTextEnv(NAMES[0], max_steps=max_steps), dict.fromkeys(ACHIEVEMENTS, 0)
    with Progress() as progress:
        task = progress.add_task("crafter-scripted", total=episodes)
        for seed in range(first_seed, first_seed + episodes):
            env.reset(seed)
            play_scripted(env)
            for a in env.unlocked:
                hits[a] += 1
            progress.advance(task)
    return {a: 100.0 * n / episodes for a, n in hits.items()}


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    p = argparse.ArgumentParser(description="Unlock rates and Crafter score of the scripted baseline.")
    p.add_argument("--episodes", type=int, default=20, help="held-out seeds (EVAL_SEED_OFFSET on)")
    p.add_argument("--max-steps", type=int, default=None, help=f"episode length (default {DEFAULT_MAX_STEPS})")
    a = p.parse_args(argv)
    rates = measure(a.episodes, max_steps=a.max_steps)
    table = Table(title=f"crafter-scripted, {a.episodes} held-out episodes, "
                        f"max_steps {a.max_steps or DEFAULT_MAX_STEPS}")
    table.add_column("achievement")
    table.add_column("unlock rate %", justify="right")
    for name, rate in rates.items():
        table.add_row(name, f"{rate:.0f}")
    table.add_row("Crafter score", f"{crafter_score(rates):.2f}")
    table.add_row("BALROG progression %", f"{balrog_progression(rates):.2f}")
    Console(width=100).print(table)


if __name__ == "__main__":
    main()
