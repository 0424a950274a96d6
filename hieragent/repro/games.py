"""``make repro-games``: the warm start + RL recipe on a family that is not BabyAI.

    python -m hieragent.repro.games [--quick] [--out DIR] [--levels ...] [--seeds 0 1 2] [--only GLOB]

SmolLM2-135M (``configs/repro_games.yaml``) on FrozenLake-4x4 (a random map per seed, as in
RAGEN), hierarchical + bank only: the expert (value iteration), untrained, warm start, and
warm start + RL over 3 seeds (``recipe.py``).
"""

from __future__ import annotations

from hieragent.repro import recipe

LEVELS = ["FrozenLake-4x4-v0"]
CONFIG = "configs/repro_games.yaml"


def main(argv: list[str] | None = None) -> None:
    recipe.main("repro-games", CONFIG, LEVELS, argv, variants=("hier",), expert="expert (value iteration)")


if __name__ == "__main__":
    main()
