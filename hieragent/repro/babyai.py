"""``make repro-babyai``: does a real LM get better with hieragent on BabyAI, and do the
hierarchy and the bank help?

    python -m hieragent.repro.babyai [--quick] [--out DIR] [--levels ...] [--seeds 0 1 2] [--only GLOB]

SmolLM2-135M (``configs/repro_babyai.yaml``) on GoToLocal and PickupLoc, through the warm
start + RL recipe of ``recipe.py``: the BabyAI bot, untrained, warm start, and warm start +
RL, flat (executor only) and hierarchical + trained, evolving bank, 3 RL seeds at equal
training env steps.
"""

from __future__ import annotations

from hieragent.repro import recipe

LEVELS = ["BabyAI-GoToLocal-v0", "BabyAI-PickupLoc-v0"]
CONFIG = "configs/repro_babyai.yaml"


def main(argv: list[str] | None = None) -> None:
    recipe.main("repro-babyai", CONFIG, LEVELS, argv, expert="BabyAI bot")


if __name__ == "__main__":
    main()
