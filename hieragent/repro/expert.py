"""The expert row of a reproduction: a level's expert on the held-out seeds, as JSON.

    python -m hieragent.repro.expert --env BabyAI-GoToLocal-v0 --episodes 128 --out result.json

The seeds are the ones ``hieragent test`` plays (``EVAL_SEED_OFFSET`` on). Writes success
rate and mean length; the expert's return is not recorded (``null``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rich.progress import track

from hieragent.envs.base import EVAL_SEED_OFFSET, check_env_name
from hieragent.envs.reference import expert_episode
from hieragent.io import atomic_write_text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="A level's expert on held-out seeds, as JSON.")
    p.add_argument("--env", required=True)
    p.add_argument("--episodes", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    try:
        check_env_name(a.env)
    except ValueError as err:
        raise SystemExit(f"hieragent.repro.expert: {err}") from None
    seeds = range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + a.episodes)
    played = [expert_episode(a.env, s) for s in track(seeds, description=f"expert on {a.env}")]
    result = {"success": statistics.fmean(float(ok) for ok, _ in played),
              "length": statistics.fmean(n for _, n in played), "return": None, "episodes": a.episodes}
    atomic_write_text(a.out, json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
