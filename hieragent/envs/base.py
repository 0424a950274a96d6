"""The text-environment interface every stage talks to, and the name -> env lookup.

An env speaks text both ways: it shows an ``Observation`` and takes free text as an
action, so that model output goes in unparsed. Bad output is an invalid step with feedback,
never an exception, because a policy in training produces garbage often.
"""

from __future__ import annotations

import difflib
import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from hieragent.types import Observation, StepResult

# Seeds from here on are held out: evaluation plays them, training never does.
EVAL_SEED_OFFSET = 1_000_000


@dataclass(frozen=True)
class Family:
    """Where one env family's code lives, by name: imported lazily, since textworld and
    minigrid are slow to import.

    Attributes:
        env: ``"module:Class"`` of its ``TextEnv``. The module also defines ``NAMES``, the
            names it accepts, unless its names come from gymnasium's registry (BabyAI).
        expert: Module of its expert. It defines ``expert_episode(name, seed) -> (success,
            length)`` (``hieragent.envs.reference``) and ``segments``.
        source: ``Demonstration.source`` of the expert's episodes.
        segments: Function of ``expert`` giving an expert episode as ``(subgoal, actions)``
            segments (``hieragent.rollout.demos``): ``f(env, seed)`` if ``segments_take_seed``,
            else ``f(env)`` on an env just reset to the episode.
        segments_take_seed: Whether ``segments`` resets the env itself.
    """

    env: str
    expert: str
    source: str
    segments: str = "expert_segments"
    segments_take_seed: bool = False


# Name prefix -> the family that serves it. A new family is one module and one line here.
FAMILIES = {
    "BabyAI-": Family("hieragent.envs.babyai:BabyAITextEnv", "hieragent.envs.expert", "babyai-bot",
                      segments_take_seed=True),
    "TextWorld-": Family("hieragent.envs.textworld:TextWorldEnv", "hieragent.envs.textworld",
                         "textworld-walkthrough", segments="walkthrough_segments"),
    "FrozenLake-": Family("hieragent.envs.frozenlake:FrozenLakeTextEnv", "hieragent.envs.frozenlake",
                          "planner-search"),
    "Sokoban-": Family("hieragent.envs.sokoban:SokobanTextEnv", "hieragent.envs.sokoban", "planner-search"),
    "ScienceWorld-": Family("hieragent.envs.scienceworld:ScienceWorldEnv", "hieragent.envs.scienceworld_gold",
                            "scienceworld-gold"),
    "Crafter-": Family("hieragent.envs.crafter:CrafterTextEnv", "hieragent.envs.crafter_scripted",
                        "crafter-scripted"),
    "TextArena-": Family("hieragent.envs.textarena:TextArenaEnv", "hieragent.envs.textarena_solvers",
                         "textarena-solver"),
}
# Shown first when a name is unknown: the levels hieragent's configs use.
_FEATURED = ("BabyAI-GoToLocal-v0", "BabyAI-GoToRedBallNoDists-v0", "BabyAI-GoToObj-v0")


def normalize(text: str) -> str:
    """Lower-case, collapse whitespace and drop a trailing period: how actions are matched."""
    return " ".join(text.lower().strip().rstrip(".").split())


def quote(text: str, limit: int = 40) -> str:
    """Model output echoed back in feedback, cut short so feedback stays a few tokens."""
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def invalid_action_feedback(action: str, valid: list[str]) -> str:
    """What an env says back to an action that is not one of ``valid``."""
    return f"invalid action {quote(action)}; valid actions: {', '.join(valid)}"


class TextEnv(ABC):
    """A text environment with a planner-facing subgoal channel.

    Attributes:
        world: What the system prompts call the env, e.g. ``"a grid world"``: "You control an
            agent in {world}." (``hieragent.agents.prompts``). Every family sets it; a
            wrapper reads it through.

    Args:
        invalid_penalty: Subtracted from the reward of a step whose action is not one of
            ``observation.actions``. That step does not move the env but counts toward
            ``max_steps``, so a policy cannot stall forever on garbage.
    """

    # No default on purpose: a family that forgot it would be prompted as another family.
    world: str

    def __init__(self, invalid_penalty: float = 0.1) -> None:
        self.invalid_penalty = invalid_penalty

    @abstractmethod
    def reset(self, seed: int) -> Observation:
        """Start an episode; the same seed gives the same episode, step for step."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Take one action given as free text (matched after ``normalize``)."""

    def set_subgoal(self, subgoal: str | None) -> str:
        """Set the executor's subgoal (``None`` clears it).

        Returns ``""`` when the subgoal could be grounded, else feedback for the planner, and
        the subgoal is then cleared. ``StepResult.subgoal_done`` reports its completion.
        A family grounds text in ``_ground``; it keeps ``name``, ``_live`` (an episode is
        running) and ``_subgoal`` (the grounded subgoal, or ``None``).
        """
        if not self._live:
            raise RuntimeError(f"{self.name}: set_subgoal() needs a live episode; call reset(seed) first")
        self._subgoal = None
        if subgoal is None:
            return ""
        grounded = self._ground(subgoal)
        if isinstance(grounded, str):
            return grounded
        self._subgoal = grounded
        return ""

    def _ground(self, text: str) -> object:
        """The grounded form of subgoal ``text``, or a ``str``: why it cannot be used."""
        raise NotImplementedError(f"{type(self).__name__} grounds no subgoals")

    @property
    @abstractmethod
    def max_steps(self) -> int:
        """Step cap of the current episode; invalid steps count toward it."""


def load(ref: str) -> Any:
    """The object ``"module:name"`` names, importing its module."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _prefix(name: str) -> str | None:
    return next((p for p in FAMILIES if name.startswith(p)), None)


def family(name: str) -> Family:
    """The family of env ``name``, by its prefix (the name itself is not checked)."""
    prefix = _prefix(name)
    if prefix is None:
        raise ValueError(f"no env family serves {name!r}; the families are "
                         f"{', '.join(p + '*' for p in FAMILIES)} (see hieragent.envs.base.FAMILIES)")
    return FAMILIES[prefix]


def env_class(name: str) -> type[TextEnv]:
    """The ``TextEnv`` class of env ``name``'s family, e.g. to read its ``world``."""
    return load(family(name).env)


def _names(prefix: str) -> list[str]:
    """The names one family accepts; imports only that family."""
    if prefix == "BabyAI-":
        import gymnasium
        import minigrid  # noqa: F401  (registers the BabyAI ids with gymnasium)

        return [k for k in gymnasium.envs.registry if k.startswith(prefix)]
    return list(importlib.import_module(FAMILIES[prefix].env.partition(":")[0]).NAMES)


def known_envs() -> list[str]:
    """Every env name ``make_env`` accepts: BabyAI in gymnasium's order, then the others."""
    return [name for prefix in FAMILIES for name in _names(prefix)]


def check_env_name(name: str) -> None:
    """Raise ``ValueError`` naming ``name`` and some known ones unless it is a known env.

    Cheap (a registry lookup, no env is built), so configs can call it at parse time.
    """
    prefix = _prefix(name)
    if prefix is not None and name in _names(prefix):
        return
    known = known_envs()
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.75)
    shown = list(dict.fromkeys(close + [f for f in _FEATURED if f in known] + known))[:6]
    raise ValueError(
        f"unknown env {name!r}; known: {', '.join(shown)}, ... "
        f"({len(known)} in all, see hieragent.envs.known_envs())"
    )


def make_env(name: str, **kwargs: object) -> TextEnv:
    """Build the env called ``name``, e.g. ``BabyAI-GoToLocal-v0`` or ``TextWorld-Easy-v0``.

    ``kwargs`` go to the env class, e.g. ``max_steps`` and ``invalid_penalty``.
    """
    check_env_name(name)
    return env_class(name)(name, **kwargs)  # type: ignore[call-arg]
