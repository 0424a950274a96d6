"""TextWorld games for hieragent: the difficulty levels, the game cache, and a generation CLI.

A game is a function of (level, seed): ``make_game`` draws the map, the objects, the quest
and the text from ``GameOptions.seeds = seed``, so the same seed gives the same game in any
process, like ``tw-make custom --world-size R --nb-objects O --quest-length L --seed S``.
Games are compiled once (Inform 7, about a second) and cached as
``<games_dir>/<level>/<seed>.z8`` next to the ``.json`` that TextWorld needs to play it.

    python -m hieragent.envs.textworld_games --level all --train 20 --heldout 10
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hieragent.envs.base import EVAL_SEED_OFFSET
from hieragent.io import cache_dir, scratch_dir


@dataclass(frozen=True)
class Level:
    """TextWorld generation settings of one difficulty (``tw-make custom`` flags)."""

    rooms: int  # --world-size
    objects: int  # --nb-objects, quest objects included
    quest_length: int  # --quest-length: commands in the walkthrough (TextWorld may use fewer)
    max_steps: int  # default step cap, several times the walkthrough


# Easy: two rooms, a quest of three commands. Hard stays at quest_breadth 1: a breadth of 2
# gives intermediate points but can take TextWorld's quest sampler over 20 s per game.
LEVELS: dict[str, Level] = {
    "TextWorld-Easy-v0": Level(rooms=2, objects=3, quest_length=3, max_steps=20),
    "TextWorld-Medium-v0": Level(rooms=4, objects=8, quest_length=6, max_steps=40),
    "TextWorld-Hard-v0": Level(rooms=8, objects=16, quest_length=12, max_steps=80),
}
MAX_ATTEMPTS = 10  # games drawn per seed until one is playable (see _build)


def default_games_dir() -> Path:
    """``<cache>/textworld``, where ``<cache>`` is ``$HIERAGENT_CACHE`` or ``~/.cache/hieragent``."""
    return cache_dir() / "textworld"


def game_path(level: str, seed: int, games_dir: str | os.PathLike | None = None) -> Path:
    """Where the compiled game of ``(level, seed)`` lives (it may not exist yet)."""
    return Path(games_dir or default_games_dir()) / level / f"{seed}.z8"


def is_complete(path: Path) -> bool:
    """A game exists once its ``.z8`` does: ``generate`` moves the ``.json`` in first."""
    return path.is_file() and path.with_suffix(".json").is_file()


def check_level(level: str) -> Level:
    if level not in LEVELS:
        raise ValueError(f"unknown env {level!r}; known: {', '.join(LEVELS)}")
    return LEVELS[level]


def generate(level: str, seed: int, games_dir: str | os.PathLike | None = None) -> Path:
    """Generate and compile the game of ``(level, seed)`` unless it is cached; returns its path.

    Built in a private temporary folder next to the target, then renamed in, so that a kill
    or a second process generating the same game never leaves half a game behind (two
    writers produce the same bytes, and ``os.replace`` is atomic).
    """
    settings = check_level(level)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    path = game_path(level, seed, games_dir)
    if is_complete(path):
        return path
    with scratch_dir(path, prefix=f".gen-{seed}-") as tmp:
        for attempt in range(MAX_ATTEMPTS):
            built = _build(settings, seed, attempt, tmp / path.name)
            if built is not None:
                break
        else:
            raise RuntimeError(f"{level} seed {seed}: no playable game in {MAX_ATTEMPTS} attempts")
        os.replace(built.with_suffix(".json"), path.with_suffix(".json"))
        os.replace(built, path)  # last: the .z8 marks the game complete
    return path


def _build(settings: Level, seed: int, attempt: int, target: Path) -> Path | None:
    """Compile attempt ``attempt`` of a game into ``target``; ``None`` if it is unplayable.

    Attempt 0 is ``tw-make``'s game for ``--seed seed``; later ones draw the four generation
    seeds from ``(seed, attempt)``, so that a retried game is as reproducible as the first.
    Unplayable: the walkthrough does not win. It happens with names such as "Henderson's
    chest" next to a "chest": Inform 7 asks "Which do you mean" and no answer resolves it.
    """
    from numpy.random import RandomState
    from textworld import GameOptions
    from textworld.generator import QuestGenerationError, compile_game, make_game

    options = GameOptions()
    if attempt == 0:
        options.seeds = seed
    else:
        draws = RandomState([seed, attempt]).randint(65635, size=4)
        options.seeds = {k: int(v) for k, v in zip(("map", "objects", "quest", "grammar"), draws)}
    options.nb_rooms, options.nb_objects = settings.rooms, settings.objects
    options.quest_length = settings.quest_length
    options.path = str(target)
    options.force_recompile = True
    try:
        game = make_game(options)
    except QuestGenerationError:
        return None
    built = Path(compile_game(game, options))
    return built if wins(built, game.walkthrough) else None


def start(game_file: str | os.PathLike, infos: Any) -> Any:
    """``textworld.start``, without jericho's warning that it does not know the game (it
    cannot: the game was just generated; TextWorld keeps the score itself)."""
    import textworld

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is not fully supported")
        return textworld.start(str(game_file), infos)


def wins(game_file: Path, commands: list[str]) -> bool:
    """Whether playing ``commands`` from the start wins the game."""
    import textworld

    env = start(game_file, textworld.EnvInfos(won=True, admissible_commands=True))
    try:
        env.reset()
        for command in commands:
            state, _, done = env.step(command)
            if done:
                return bool(state["won"])
        return False
    finally:
        env.close()


def seeds(train: int, heldout: int) -> list[int]:
    """Training seeds ``0..train-1`` and held-out seeds from ``EVAL_SEED_OFFSET`` on."""
    return list(range(train)) + [EVAL_SEED_OFFSET + i for i in range(heldout)]


def _generate(job: tuple[str, int, str | None]) -> None:
    generate(*job)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hieragent.envs.textworld_games",
        description="Generate TextWorld games into the hieragent cache (skips games already there).",
    )
    parser.add_argument("--level", default="all", choices=[*LEVELS, "all"], help="a level, or all of them")
    parser.add_argument("--train", type=int, default=20, help="training games: seeds 0..N-1")
    parser.add_argument("--heldout", type=int, default=10, help=f"held-out games: seeds {EVAL_SEED_OFFSET}..")
    parser.add_argument("--games-dir", default=None, help=f"default: {default_games_dir()}")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="parallel processes")
    args = parser.parse_args(argv)
    levels = list(LEVELS) if args.level == "all" else [args.level]
    jobs = [(lv, s, args.games_dir) for lv in levels for s in seeds(args.train, args.heldout)]
    todo = [j for j in jobs if not is_complete(game_path(*j))]
    from rich.progress import Progress

    with Progress() as progress:
        task = progress.add_task(f"TextWorld games ({len(jobs) - len(todo)} cached)", total=len(todo))
        if args.jobs <= 1 or len(todo) <= 1:
            for job in todo:
                _generate(job)
                progress.advance(task)
        else:  # spawn: the caller may hold threads (torch) that a fork would copy mid-state
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=args.jobs, mp_context=context) as pool:
                for future in as_completed([pool.submit(_generate, j) for j in todo]):
                    future.result()
                    progress.advance(task)
    print(f"{len(jobs)} games in {Path(args.games_dir or default_games_dir())}")


if __name__ == "__main__":
    main()
