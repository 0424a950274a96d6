"""``hieragent export`` and ``hieragent play``: take a trained agent out of its run.

    hieragent export --ckpt_path last.ckpt --out agent/
    hieragent play   --ckpt_path last.ckpt|agent/ --env BabyAI-GoToLocal-v0 --seed 3 [--json ep.json]

``export`` writes the folder described in ``lightning/export.py``. ``play`` runs one episode
with the trained planner, executor and bank, greedily unless ``--sample``, and prints it as
a transcript: the mission, each subgoal with the skills retrieved for it, each action with
its reward and the observation that followed, and the outcome. ``--json`` saves the same
transcript. The episode is the one ``hieragent test`` would play on that seed: the same
rollout code acts, only watched.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from hieragent.io import atomic_write_text
from hieragent.types import StepResult, Trajectory


def export_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="hieragent export",
                                description="Write a checkpoint's agent as PEFT adapters, bank and model card.")
    p.add_argument("--ckpt_path", required=True, help="a checkpoint written by hieragent fit")
    p.add_argument("--out", required=True, type=Path, help="the folder to write (new, or an earlier export)")
    a = p.parse_args(argv)
    from hieragent.lightning.export import export_agent

    out = export_agent(a.ckpt_path, a.out)
    print(f"agent exported to {out}: {', '.join(sorted(f.name for f in out.iterdir()))}")


class _Watched:
    """An env pool whose subgoal feedback and step results are kept, in order, for the
    transcript; everything else is the pool's own."""

    def __init__(self, pool) -> None:
        self.pool, self.first = pool, None
        self.subgoals: list[str] = []
        self.steps: list[StepResult] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    def __len__(self) -> int:
        return len(self.pool)

    def reset(self, seeds):
        observations = self.pool.reset(seeds)
        self.first = observations[0]
        return observations

    def set_subgoals(self, subgoals):
        feedback = self.pool.set_subgoals(subgoals)
        self.subgoals += [feedback.get(i, "") for i, s in subgoals.items() if s is not None]
        return feedback

    def step(self, actions):
        results = self.pool.step(actions)
        self.steps += [results[i] for i in actions]
        return results


def transcript(trajectory: Trajectory, watched: _Watched, bank) -> list[dict[str, Any]]:
    """The episode's turns in order, each with what the env answered."""
    steps, feedback = iter(watched.steps), iter(watched.subgoals)
    out: list[dict[str, Any]] = []
    for turn in trajectory.turns:
        if turn.role == "planner":
            skills: list[str] = []
            if turn.retrieval is not None and bank is not None:
                skills = bank.texts([turn.retrieval.entry_ids[c] for c in turn.retrieval.chosen])
            out.append({"role": "planner", "subgoal": turn.text, "skills": skills,
                        "feedback": next(feedback)})
            continue
        result = next(steps)
        out.append({"role": "executor", "action": turn.text, "reward": result.reward,
                    "observation": result.observation.text, "feedback": result.feedback,
                    "subgoal_done": result.subgoal_done, "done": result.done})
    return out


def play_pool(source: str | Path, env: str, max_steps: int | None = None):
    """A one-env pool of ``env`` as the run behind ``source`` built its pools (episode cap,
    invalid-action penalty, loop guard, workers; its env options only for its own env)."""
    import inspect

    from hieragent.lightning.datamodule import RolloutDataModule
    from hieragent.lightning.export import saved_data_settings

    known = inspect.signature(RolloutDataModule).parameters
    data = {k: v for k, v in saved_data_settings(source).items() if k in known}
    if env != data.get("env"):
        data.pop("env_options", None)
    if max_steps is not None:
        data["max_episode_steps"] = max_steps
    data.update(env=env, test_envs=None)
    return RolloutDataModule(**data).eval_pool(1, env)


def play(source: str | Path, env: str, seed: int, greedy: bool = True,
         max_steps: int | None = None) -> dict[str, Any]:
    """One episode of the agent in checkpoint or exported folder ``source`` on ``env``'s
    ``seed``; returns the transcript as a dict (see ``print_transcript``)."""
    import torch

    from hieragent.lightning.export import module_from

    module = module_from(source, "hieragent play")
    with play_pool(source, env, max_steps) as pool:
        watched = _Watched(pool)
        generator = None if greedy else torch.Generator().manual_seed(seed)
        batch = module.collect(watched, [seed], [0], greedy=greedy, generator=generator)
    if not batch.trajectories:
        raise RuntimeError(f"the {env} env failed during the episode (seed {seed}); see the log")
    trajectory = batch.trajectories[0]
    return {"env": env, "seed": seed, "greedy": greedy, "source": str(source),
            "mission": trajectory.mission, "observation": watched.first.text,
            "turns": transcript(trajectory, watched, module.bank),
            "success": trajectory.success, "return": trajectory.env_return, "length": trajectory.length,
            "invalid_actions": trajectory.invalid_actions}


def print_transcript(episode: dict[str, Any], console: Console) -> None:
    say = lambda text="", style=None: console.print(text, style=style, markup=False, highlight=False)  # noqa: E731
    say(f"{episode['env']}, seed {episode['seed']} ({'greedy' if episode['greedy'] else 'sampled'})",
        style="bold")
    say(f"mission: {episode['mission']}")
    say(f"  {episode['observation']}", style="dim")
    step = 0
    for turn in episode["turns"]:
        if turn["role"] == "planner":
            say(f"subgoal: {turn['subgoal']}", style="bold cyan")
            for skill in turn["skills"]:
                say(f"  skill: {skill}", style="cyan")
            if turn["feedback"]:
                say(f"  ! {turn['feedback']}", style="yellow")
            continue
        step += 1
        done = "  (subgoal done)" if turn["subgoal_done"] else ""
        say(f"{step:3d}. {turn['action']}   reward {turn['reward']:+.3f}{done}")
        if turn["feedback"]:
            say(f"     ! {turn['feedback']}", style="yellow")
        say(f"     {turn['observation']}", style="dim")
    outcome = "success" if episode["success"] else "failure"
    say(f"{outcome}: return {episode['return']:.3f}, {episode['length']} steps, "
        f"{episode['invalid_actions']} invalid", style="bold green" if episode["success"] else "bold red")


def play_main(argv: list[str]) -> None:
    from hieragent.lightning.datamodule import EVAL_SEED_OFFSET

    p = argparse.ArgumentParser(prog="hieragent play", description="Play one episode with a trained agent.")
    p.add_argument("--ckpt_path", required=True, help="a checkpoint of hieragent fit, or a folder of hieragent export")
    p.add_argument("--env", default=None, help="an env name (`hieragent envs`); default: the run's training env")
    p.add_argument("--seed", type=int, default=EVAL_SEED_OFFSET,
                   help="the env seed (default: the first held-out one)")
    p.add_argument("--sample", action="store_true", help="sample actions (seeded by --seed) instead of greedy")
    p.add_argument("--max_steps", type=int, default=None, help="episode cap (default: the run's)")
    p.add_argument("--json", type=Path, default=None, help="also save the transcript here")
    a = p.parse_args(argv)
    from hieragent.lightning.export import saved_data_settings

    env = a.env or saved_data_settings(a.ckpt_path).get("env")
    if not env:
        raise ValueError(f"--env is needed: '{a.ckpt_path}' does not record the env it was trained on")
    episode = play(a.ckpt_path, env, a.seed, greedy=not a.sample, max_steps=a.max_steps)
    print_transcript(episode, Console())
    if a.json is not None:
        atomic_write_text(a.json, json.dumps(episode, indent=2))
