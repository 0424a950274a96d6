"""Expert demonstrations: expert episodes replayed into planner and executor steps, as JSONL.

An expert gives an episode as ``(subgoal, actions)`` segments: minigrid's BabyAI bot
(cut where our subgoals complete, see ``hieragent.envs.expert``), TextWorld's walkthrough,
or the shortest-path planners of FrozenLake and Sokoban. ``record`` replays the segments
on a fresh env, recording what the planner and the executor saw and chose, and checks on
the way that every subgoal is accepted and completes on its segment's last action and that
the episode succeeds. One ``Demonstration`` (``hieragent.types``) is one line:

    {"env": "BabyAI-GoToLocal-v0", "seed": 3, "mission": "go to the red ball",
     "source": "babyai-bot", "success": true, "length": 5,
     "planner": [{"observation": "You see ...", "candidates": ["go to the red ball", ...],
                  "subgoal": "go to the red ball"}],
     "executor": [{"subgoal": "go to the red ball", "observation": "You see ...",
                   "candidates": ["turn left", ...], "action": "go forward"}, ...]}

``python -m hieragent.rollout.demos --env BabyAI-GoToLocal-v0 --episodes 200`` writes a
file (atomically) for the warm-start stage, ``data.demos`` in an SFT config.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path

from rich.progress import Progress

from hieragent.envs.base import TextEnv, family, load, make_env
from hieragent.io import iter_jsonl, write_jsonl
from hieragent.types import Demonstration, ExecutorStep, PlannerStep

Segments = list[tuple[str, list[str]]]


def expert_for(name: str) -> tuple[Callable[[TextEnv, int], Segments], str]:
    """The expert of env ``name`` as ``segments(env, seed)``, and its source label
    (``hieragent.envs.base.FAMILIES``)."""
    fam = family(name)
    expert = load(f"{fam.expert}:{fam.segments}")
    if fam.segments_take_seed:
        return expert, fam.source

    def segments(env: TextEnv, seed: int) -> Segments:
        env.reset(seed)
        return expert(env)

    return segments, fam.source


def record(env: TextEnv, name: str, seed: int, segments: Segments, source: str) -> Demonstration:
    """Replay ``segments`` on ``env`` from ``reset(seed)`` and record every decision.

    Raises ``ValueError`` if the replay disagrees with the segments: a subgoal refused, a
    subgoal that does not complete on its segment's last action, or an episode that does
    not end in success.
    """
    obs = env.reset(seed)
    demo = Demonstration(env=name, seed=seed, mission=obs.mission, source=source, success=False,
                         length=0)
    result = None
    for subgoal, actions in segments:
        demo.planner.append(PlannerStep(obs.text, list(obs.subgoals), subgoal))
        feedback = env.set_subgoal(subgoal)
        if feedback:
            raise ValueError(f"{name} seed {seed}: expert subgoal {subgoal!r} refused: {feedback}")
        for k, action in enumerate(actions):
            demo.executor.append(ExecutorStep(subgoal, obs.text, list(obs.actions), action))
            result = env.step(action)
            obs = result.observation
            demo.length += 1
            last = k == len(actions) - 1
            if result.invalid or result.subgoal_done != last and not (last and result.success):
                raise ValueError(f"{name} seed {seed}: step {demo.length} ({action!r}) under "
                                 f"{subgoal!r}: invalid={result.invalid}, "
                                 f"subgoal_done={result.subgoal_done}, expected done={last}")
            if result.done and not last:
                raise ValueError(f"{name} seed {seed}: episode ended inside segment {subgoal!r}")
    if result is None or not result.success:
        raise ValueError(f"{name} seed {seed}: the expert's episode did not succeed")
    demo.success = True
    return demo


def demonstrations(name: str, seeds: Iterable[int], progress: Progress | None = None,
                   **env_kwargs: object) -> Iterator[Demonstration]:
    """Successful expert episodes on ``seeds``; seeds the expert fails are skipped."""
    env = make_env(name, **env_kwargs)
    expert, source = expert_for(name)
    seeds = list(seeds)
    task = progress.add_task(f"demos {name}", total=len(seeds)) if progress is not None else None
    for seed in seeds:
        segments = expert(env, seed)
        if segments:
            yield record(env, name, seed, segments, source)
        if task is not None:
            progress.advance(task)


def write_demonstrations(demos: Iterable[Demonstration], path: Path) -> int:
    """Write ``demos`` to ``path`` as JSONL, atomically; returns the count."""
    return write_jsonl((asdict(d) for d in demos), path)


def resolve(path: str | Path) -> Path:
    """``cache:demos/x.jsonl`` is under hieragent's cache directory; anything else as given."""
    from hieragent.models.loading import cache_dir

    text = str(path)
    return cache_dir() / text[len("cache:"):] if text.startswith("cache:") else Path(text)


def read_demonstrations(path: str | Path) -> list[Demonstration]:
    """Demonstrations from a JSONL file; a bad line is an error naming the file and line."""
    path = resolve(path)
    if not path.is_file():
        raise FileNotFoundError(f"demonstrations file '{path}' does not exist; write one with "
                                "`python -m hieragent.rollout.demos --env <name> --out <file>`")
    out = []
    for lineno, raw in iter_jsonl(path):
        try:
            raw["planner"] = [PlannerStep(**p) for p in raw.get("planner", [])]
            raw["executor"] = [ExecutorStep(**e) for e in raw.get("executor", [])]
            out.append(Demonstration(**raw))
        except TypeError as err:
            raise ValueError(f"{path}:{lineno}: not a demonstration ({err}); see "
                             "hieragent.rollout.demos for the schema") from None
    if not out:
        raise ValueError(f"demonstrations file '{path}' holds no demonstrations")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write expert demonstrations as JSONL.")
    p.add_argument("--env", required=True, help="env name, e.g. BabyAI-GoToLocal-v0")
    p.add_argument("--episodes", type=int, default=200, help="seeds 0..N-1 (training seeds)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="output file; cache:... is under the cache (default: cache:demos/<env>.jsonl)")
    a = p.parse_args(argv)
    out = resolve(a.out or f"cache:demos/{a.env}.jsonl")
    seeds = range(a.first_seed, a.first_seed + a.episodes)
    with Progress() as progress:
        n = write_demonstrations(demonstrations(a.env, seeds, progress), out)
    print(f"{n} of {a.episodes} episodes written to {out}")


if __name__ == "__main__":
    main()
