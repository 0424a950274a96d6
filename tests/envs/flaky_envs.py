"""A test-only env that fails on purpose; a module of its own so that spawned pool workers
can import it (``EnvPool.make(..., factory=FlakyEnv)``)."""

from __future__ import annotations

import os
import signal
import time

from hieragent.envs import BabyAITextEnv, TextEnv
from hieragent.types import Observation, StepResult


class FlakyEnv(TextEnv):
    """A BabyAI level that fails in the episodes of chosen seeds, and is plain BabyAI otherwise.

    Args:
        level: BabyAI level.
        faults: ``seed -> (kind, when)``. ``kind``: ``"raise"`` (a RuntimeError), ``"hang"``
            (sleeps for ten minutes) or ``"die"`` (SIGKILLs its own process: workers only).
            ``when``: ``"reset"``, ``"set_subgoal"`` (the episode's first one) or ``k``
            (the k-th step, from 1).
        **kwargs: For ``BabyAITextEnv``.
    """

    world = BabyAITextEnv.world

    def __init__(self, level: str, faults: dict[int, tuple[str, str | int]] | None = None,
                 **kwargs: object) -> None:
        self.inner = BabyAITextEnv(level, **kwargs)  # type: ignore[arg-type]
        super().__init__(self.inner.invalid_penalty)
        self.faults = faults or {}
        self._fault: tuple[str, str | int] | None = None
        self._steps = 0

    @property
    def max_steps(self) -> int:
        return self.inner.max_steps

    @property
    def unwrapped(self):
        return self.inner.unwrapped

    def reset(self, seed: int) -> Observation:
        self._fault, self._steps = self.faults.get(seed), 0
        self._maybe_fail("reset")
        return self.inner.reset(seed)

    def set_subgoal(self, subgoal: str | None) -> str:
        self._maybe_fail("set_subgoal")
        return self.inner.set_subgoal(subgoal)

    def step(self, action: str) -> StepResult:
        self._steps += 1
        self._maybe_fail(self._steps)
        return self.inner.step(action)

    def _maybe_fail(self, now: str | int) -> None:
        if self._fault is None or self._fault[1] != now:
            return
        kind = self._fault[0]
        if kind == "raise":
            raise RuntimeError(f"injected fault in {now}")
        if kind == "hang":
            time.sleep(600)
        elif kind == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
