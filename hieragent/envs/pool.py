"""Many text envs stepped as one batch, so that rollout makes one policy call per turn.

The envs run in this process, or in worker processes (``EnvPool.make(..., workers=W)``,
see ``workers.py``); the interface and the results are the same either way.

Env failures never raise. An env whose method raises, or whose worker hangs or dies,
loses its episode: the pool answers for it with a failed result (below), puts its index
in ``pool.failed`` and counts it in ``pool.dropped_episodes``; everything else goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from hieragent.envs.base import TextEnv, check_env_name, make_env
from hieragent.envs.workers import EnvSpec, WorkerGroup, apply
from hieragent.types import Observation, StepResult

logger = logging.getLogger(__name__)

# Start of the feedback of a failed env's answers (the caller checks ``pool.failed``).
FAILED_FEEDBACK = "env failed: "


def empty_observation() -> Observation:
    """What ``reset`` answers for an env that failed to reset."""
    return Observation(mission="", text="", actions=[], subgoals=[])


def failed_result(reason: str) -> StepResult:
    """What ``step`` answers for a failed env: the episode is over and did not succeed."""
    return StepResult(observation=empty_observation(), reward=0.0, done=True, success=False,
                      feedback=f"{FAILED_FEEDBACK}{reason}; episode dropped")


class EnvPool:
    """A fixed list of envs, addressed by index.

    Failures, and what a caller does about them:

    * ``pool.failed`` holds the indices whose current episode was dropped: the env's
      ``reset``, ``step`` or ``set_subgoal`` raised, or its worker process hung past
      ``step_timeout`` or died (then every env on that worker with an episode in progress
      is dropped, called or not). ``reset`` clears an index that resets cleanly.
      ``pool.dropped_episodes`` counts dropped episodes over the pool's life.
    * A failed env is answered, never raised for: ``step`` gives ``failed_result`` (``done=True``,
      ``success=False``, reward 0, an empty observation, feedback starting ``"env failed: "``),
      ``set_subgoals`` gives that feedback, and ``reset`` gives an empty ``Observation``.
    * Until it is reset, a failed env is not called again: ``step`` and ``set_subgoals`` on
      it answer the same way at once. So does calling an env with no episode in progress
      (never reset, or already done); the index is then put in ``failed`` but not counted.
    * So the rollout loop keeps going as if the episode had ended, and afterwards drops the
      trajectories whose index is in ``pool.failed`` (skipping them already right after
      ``reset``, since their observation is empty). ``len(pool.failed)`` after a rollout
      is the number it dropped.

    In-process mode catches exceptions the same way but cannot time out: an env that hangs
    hangs the caller. Use ``workers >= 1`` for that protection.

    Args:
        envs: The envs, index ``i`` of every call meaning ``envs[i]``, run in this process;
            or a ``WorkerGroup`` that runs them in worker processes.
    """

    def __init__(self, envs: Sequence[TextEnv] | WorkerGroup) -> None:
        if isinstance(envs, WorkerGroup):
            self._group: WorkerGroup | None = envs
            self._envs: list[TextEnv] | None = None
            self._n = envs.n
        else:
            if not envs:
                raise ValueError("EnvPool needs at least one env")
            self._group, self._envs, self._n = None, list(envs), len(envs)
        self.failed: set[int] = set()
        self.dropped_episodes = 0
        self._live: set[int] = set()  # indices with an episode in progress
        self._why: dict[int, str] = {}  # why each index in ``failed`` failed

    @classmethod
    def make(cls, name: str, n: int, *, workers: int = 0, step_timeout: float | None = 60.0,
             loop_guard: int | None = None, loop_penalty: float = 1.0,
             factory: Callable[..., TextEnv] = make_env, **env_kwargs: Any) -> EnvPool:
        """``n`` envs built by ``factory(name, **env_kwargs)`` (default ``make_env``).

        Args:
            workers: ``0`` runs the envs in this process; ``W >= 1`` splits them over
                ``min(W, n)`` worker processes, each building its own.
            step_timeout: Seconds a worker may take to answer one call (its whole slice of
                envs); past it the worker is restarted and its episodes dropped. ``None``
                waits forever. Workers only.
            loop_guard: Wrap every env in ``LoopGuard`` with ``repeats=loop_guard``.
            loop_penalty: The guard's penalty on the step that ends a loop.
            factory: Builds one env; with workers it must be importable by name.
        """
        if n < 1:
            raise ValueError(f"EnvPool.make needs n >= 1, got {n}")
        if workers < 0:
            raise ValueError(f"EnvPool.make needs workers >= 0, got {workers}")
        if factory is make_env:
            check_env_name(name)  # fail here, not in a worker
        spec = EnvSpec(name, dict(env_kwargs), factory, loop_guard, loop_penalty)
        if workers == 0:
            return cls([spec.build() for _ in range(n)])
        return cls(WorkerGroup(spec, n, min(workers, n), step_timeout))

    def __len__(self) -> int:
        return self._n

    @property
    def envs(self) -> list[TextEnv]:
        """The envs themselves (in-process only)."""
        if self._envs is None:
            raise AttributeError("this EnvPool runs its envs in worker processes, so they cannot be "
                                 "reached from here; use pool.invalid_penalty(i), or workers=0")
        return self._envs

    def invalid_penalty(self, i: int) -> float:
        """Env ``i``'s penalty for an invalid action or subgoal."""
        if self._group is not None:
            return self._group.penalties[i]
        return float(self.envs[i].invalid_penalty)

    def world(self, i: int) -> str:
        """Env ``i``'s ``TextEnv.world``, for the system prompts."""
        if self._group is not None:
            return self._group.worlds[i]
        return self.envs[i].world

    @property
    def restarts(self) -> int:
        """How many times a worker process was restarted (0 in-process)."""
        return self._group.restarts if self._group is not None else 0

    def worker_pid(self, i: int) -> int | None:
        """Process id of the worker that runs env ``i`` now; ``None`` in-process."""
        return self._group.pid(i) if self._group is not None else None

    def reset(self, seeds: Sequence[int]) -> list[Observation]:
        """Reset every env, env ``i`` with ``seeds[i]``."""
        if len(seeds) != self._n:
            raise ValueError(f"reset got {len(seeds)} seeds for {self._n} envs")
        self.failed.clear()
        self._live.clear()
        self._why.clear()
        values, _ = self._call("reset", dict(enumerate(seeds)))
        self._live = set(values)
        return [values[i] if i in values else empty_observation() for i in range(self._n)]

    def step(self, actions: dict[int, str]) -> dict[int, StepResult]:
        """Step only the envs named in ``actions`` (the others, e.g. finished ones, wait)."""
        values, reasons = self._call("step", actions)
        self._live -= {i for i, r in values.items() if r.done}
        return {i: values[i] if i in values else failed_result(reasons[i]) for i in actions}

    def set_subgoals(self, subgoals: dict[int, str | None]) -> dict[int, str]:
        """Set subgoals on the envs named; returns each env's feedback (``""`` if grounded)."""
        values, reasons = self._call("set_subgoal", subgoals)
        return {i: values[i] if i in values else f"{FAILED_FEEDBACK}{reasons[i]}" for i in subgoals}

    def close(self) -> None:
        """Stop the worker processes, if any; idempotent. Also done on garbage collection."""
        if self._group is not None:
            self._group.close()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, args: dict[int, Any]) -> tuple[dict[int, Any], dict[int, str]]:
        """Run ``method`` on the live envs named; returns values, and why the others failed."""
        bad = [i for i in args if not 0 <= i < self._n]
        if bad:
            raise IndexError(f"env indices {bad} out of range for a pool of {self._n}")
        reasons: dict[int, str] = {}
        if method != "reset":
            for i in [i for i in args if i not in self._live]:
                earlier = self._why.get(i, "not reset since it was built, or its episode ended")
                reasons[i] = f"env {i} has no episode in progress ({earlier}); reset it first"
                self.failed.add(i)
                logger.warning("env %d called without an episode in progress", i)
        live = {i: a for i, a in args.items() if i not in reasons}
        if self._group is not None:
            values, failures = self._group.call(method, live)
        else:
            values, failures = apply(dict(enumerate(self.envs)), method, live)
        for i, why in failures.items():
            # A restarted worker names all its envs; those whose episode had ended lose nothing.
            if i in live or i in self._live:
                self._drop(i, why)
                reasons[i] = why
        return values, reasons

    def _drop(self, i: int, why: str) -> None:
        logger.warning("env %d failed, its episode is dropped: %s", i, why)
        self._live.discard(i)
        self.failed.add(i)
        self._why[i] = why
        self.dropped_episodes += 1
