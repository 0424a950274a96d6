"""Many text envs stepped as one batch, so that rollout makes one policy call per turn.

Everything crosses the pool boundary as indices, strings and ``types`` dataclasses, so a
version with worker processes can keep this interface: each worker would own a slice of
``envs`` and answer the same three calls.
"""

from __future__ import annotations

from collections.abc import Sequence

from hieragent.envs.base import TextEnv, make_env
from hieragent.types import Observation, StepResult


class EnvPool:
    """A fixed list of envs, addressed by index; runs them in this process, in order.

    Args:
        envs: The envs; index ``i`` of every call refers to ``envs[i]``.
    """

    def __init__(self, envs: Sequence[TextEnv]) -> None:
        if not envs:
            raise ValueError("EnvPool needs at least one env")
        self.envs = list(envs)

    @classmethod
    def make(cls, name: str, n: int, **env_kwargs: object) -> EnvPool:
        """``n`` envs built by ``make_env(name, **env_kwargs)``."""
        if n < 1:
            raise ValueError(f"EnvPool.make needs n >= 1, got {n}")
        return cls([make_env(name, **env_kwargs) for _ in range(n)])

    def __len__(self) -> int:
        return len(self.envs)

    def reset(self, seeds: Sequence[int]) -> list[Observation]:
        """Reset every env, env ``i`` with ``seeds[i]``."""
        if len(seeds) != len(self.envs):
            raise ValueError(f"reset got {len(seeds)} seeds for {len(self.envs)} envs")
        return [env.reset(seed) for env, seed in zip(self.envs, seeds)]

    def step(self, actions: dict[int, str]) -> dict[int, StepResult]:
        """Step only the envs named in ``actions`` (the others, e.g. finished ones, wait)."""
        self._check(actions)
        return {i: self.envs[i].step(a) for i, a in actions.items()}

    def set_subgoals(self, subgoals: dict[int, str | None]) -> dict[int, str]:
        """Set subgoals on the envs named; returns each env's feedback (``""`` if grounded)."""
        self._check(subgoals)
        return {i: self.envs[i].set_subgoal(s) for i, s in subgoals.items()}

    def _check(self, indexed: dict[int, object]) -> None:
        bad = [i for i in indexed if not 0 <= i < len(self.envs)]
        if bad:
            raise IndexError(f"env indices {bad} out of range for a pool of {len(self.envs)}")
