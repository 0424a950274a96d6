"""The env-family registry (``hieragent.envs.base.FAMILIES``): every entry resolves, and
make_env and the expert table read it."""

import importlib

import pytest

from hieragent.envs.base import FAMILIES, TextEnv, env_class, family, load, make_env

FIRST = {"BabyAI-": "BabyAI-GoToLocal-v0", "TextWorld-": "TextWorld-Easy-v0",
         "FrozenLake-": "FrozenLake-4x4-v0", "Sokoban-": "Sokoban-6x6-1box-v0",
         "ScienceWorld-": "ScienceWorld-find-plant-v0", "Crafter-": "Crafter-v0",
         "TextArena-": "TextArena-TowerOfHanoi-v0"}


def test_every_family_names_a_text_env_with_a_world_and_an_expert() -> None:
    assert set(FIRST) == set(FAMILIES)
    worlds = set()
    for prefix, fam in FAMILIES.items():
        cls = env_class(FIRST[prefix])
        assert issubclass(cls, TextEnv) and cls is load(fam.env)
        assert isinstance(cls.world, str) and cls.world.startswith("a ")
        worlds.add(cls.world)
        expert = importlib.import_module(fam.expert)
        assert callable(expert.expert_episode) and callable(getattr(expert, fam.segments))
    assert len(worlds) == len(FAMILIES)  # no family is prompted as another


def test_babyai_keeps_the_world_its_figures_were_measured_in() -> None:
    assert env_class("BabyAI-GoToLocal-v0").world == "a grid world"


def test_an_unknown_prefix_is_an_error_naming_the_families() -> None:
    with pytest.raises(ValueError, match=r"'Atari-Pong-v0'.*BabyAI-\*.*Sokoban-\*"):
        family("Atari-Pong-v0")


def test_make_env_builds_the_class_the_registry_names() -> None:
    env = make_env("FrozenLake-4x4-v0")
    assert type(env) is env_class("FrozenLake-4x4-v0") and env.world == "a frozen lake grid"


def test_the_expert_table_plays_each_familys_own_expert() -> None:
    from hieragent.envs import frozenlake, sokoban
    from hieragent.envs.reference import expert_episode

    for module, name in ((frozenlake, "FrozenLake-4x4-v0"), (sokoban, "Sokoban-6x6-1box-v0")):
        assert expert_episode(name, 1_000_003) == module.expert_episode(name, 1_000_003)
