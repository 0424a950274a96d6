"""System prompts per env family: BabyAI's text is exactly the one the figures were measured
on, and every other family names its own world."""

import pytest

from hieragent.agents.prompts import DEFAULT_WORLD, EXECUTOR_SYSTEM, PLANNER_SYSTEM, system_text
from hieragent.engines.prompting import Prompter
from hieragent.envs.base import FAMILIES, load

# the system prompts before they were made per family, byte for byte
BABYAI_PLANNER = "You are the planner of an agent in a grid world. Reply with the next subgoal."
BABYAI_EXECUTOR = "You control an agent in a grid world. Reply with the next action."


def test_babyai_prompts_are_byte_identical_and_the_default() -> None:
    babyai = load(FAMILIES["BabyAI-"].env).world
    assert babyai == DEFAULT_WORLD
    assert system_text(PLANNER_SYSTEM) == system_text(PLANNER_SYSTEM, babyai) == BABYAI_PLANNER
    assert system_text(EXECUTOR_SYSTEM) == system_text(EXECUTOR_SYSTEM, babyai) == BABYAI_EXECUTOR


def test_other_families_are_not_called_a_grid_world() -> None:
    for prefix in (p for p in FAMILIES if p != "BabyAI-"):
        world = load(FAMILIES[prefix].env).world
        text = system_text(EXECUTOR_SYSTEM, world)
        assert world in text and "grid world" not in text


@pytest.mark.parametrize("role", ["planner", "executor"])
def test_prompt_ids_put_the_world_in_the_system_turn(role, tokenizer) -> None:
    prompter = Prompter(tokenizer)
    old = BABYAI_PLANNER if role == "planner" else BABYAI_EXECUTOR
    chat = [{"role": "system", "content": old}, {"role": "user", "content": "Mission: x"}]
    expected = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert prompter.prompt(role, "Mission: x")[0] == expected  # default: BabyAI, unchanged
    adventure = tokenizer.decode(prompter.prompt(role, "Mission: x", world="a text adventure")[0])
    assert "agent in a text adventure." in adventure and "grid world" not in adventure
