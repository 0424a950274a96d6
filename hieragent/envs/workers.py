"""Worker processes for ``EnvPool``: each owns a slice of the envs and answers batched calls.

A call is one message per worker (``(method, {index: argument})``) and one answer per
worker (``({index: value}, {index: failure reason})``): plain indices, strings and
``types`` dataclasses, nothing else. Workers are started with the ``spawn`` context,
because the parent has torch loaded and forking it is unsafe; a worker builds its envs
from an ``EnvSpec`` (name, kwargs, an importable factory), not from pickled envs.

Failures are contained at two levels. An exception in an env's method is caught in the
worker and reported for that env alone; the worker and its other envs go on. A worker
that dies, or does not answer within ``timeout`` seconds, is killed and started afresh
(its envs rebuilt), and every env it held is reported failed.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from hieragent.envs.base import TextEnv, make_env
from hieragent.envs.guards import LoopGuard

logger = logging.getLogger(__name__)

METHODS = ("reset", "step", "set_subgoal")
# Seconds a (re)started worker may take to import its modules and build its envs; apart
# from the call timeout, because a spawn re-imports the parent's main module too.
START_TIMEOUT = 120.0


@dataclass
class EnvSpec:
    """How to build one env of a pool: plain data, so that a worker process can build it.

    Attributes:
        name: Env name, passed to ``factory`` first.
        env_kwargs: Keyword arguments for ``factory``.
        factory: ``factory(name, **env_kwargs) -> TextEnv``; for workers it must be
            importable (a module-level function or class), since it is pickled by name.
        loop_guard: Wrap every env in ``LoopGuard(env, repeats=loop_guard)``; ``None``: don't.
        loop_penalty: The guard's penalty.
    """

    name: str
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    factory: Callable[..., TextEnv] = make_env
    loop_guard: int | None = None
    loop_penalty: float = 1.0

    def build(self) -> TextEnv:
        env = self.factory(self.name, **self.env_kwargs)
        if self.loop_guard is not None:
            env = LoopGuard(env, repeats=self.loop_guard, penalty=self.loop_penalty)
        return env


def failure_reason(what: str, exc: BaseException) -> str:
    """``step raised ValueError: boom (at flaky_envs.py:40)``: one line, for feedback and logs."""
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{what} raised {type(exc).__name__}: {exc}{at}"


def apply(envs: dict[int, TextEnv], method: str, args: dict[int, Any]) -> tuple[dict[int, Any], dict[int, str]]:
    """Call ``envs[i].<method>(args[i])`` for each ``i``; an exception fails that env only.

    Returns the values of the calls that returned and the reasons of those that raised.
    """
    if method not in METHODS:
        raise ValueError(f"unknown env method {method!r}; known: {', '.join(METHODS)}")
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    for i, arg in args.items():
        try:
            values[i] = getattr(envs[i], method)(arg)
        except Exception as exc:  # an env bug must not end training; the caller drops the episode
            failures[i] = failure_reason(method, exc)
    return values, failures


def _serve(conn: Connection, spec: EnvSpec, indices: list[int]) -> None:
    """A worker's main loop: build the envs, then answer calls until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; it closes us
    try:
        envs = {i: spec.build() for i in indices}
        facts = {i: (float(env.invalid_penalty), env.world) for i, env in envs.items()}
    except Exception as exc:
        conn.send(("error", failure_reason("building the env", exc)))
        return
    conn.send(("ready", facts))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        if message is None:
            return
        conn.send(apply(envs, *message))


class _Worker:
    """The parent's handle on one worker process and its slice of env indices."""

    def __init__(self, context: Any, spec: EnvSpec, indices: list[int]) -> None:
        self.context, self.spec, self.indices = context, spec, indices
        self.penalties: dict[int, float] = {}
        self.worlds: dict[int, str] = {}
        self.start()

    def start(self) -> None:
        conn, child = self.context.Pipe()
        self.process = self.context.Process(target=_serve, args=(child, self.spec, self.indices),
                                            name="hieragent-env-worker", daemon=True)
        self.process.start()
        child.close()  # so that our recv sees EOF when the worker dies
        self.conn: Connection = conn
        self.ready = False

    def take_ready(self) -> str:
        """Read the worker's start-up message; ``""`` when it is ready, else why not."""
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            return self.death()
        if kind == "error":
            return f"worker {self.process.pid} could not build its envs: {payload}"
        self.penalties = {i: penalty for i, (penalty, _) in payload.items()}
        self.worlds = {i: world for i, (_, world) in payload.items()}
        self.ready = True
        return ""

    def death(self) -> str:
        self.process.join(1.0)
        return f"worker {self.process.pid} died (exit code {self.process.exitcode})"

    def stop(self, graceful: bool) -> None:
        if graceful:
            try:
                self.conn.send(None)
            except OSError:
                pass
        else:
            self.process.kill()

    def reap(self) -> None:
        self.process.join(2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def _stop_all(workers: list[_Worker]) -> None:
    for w in workers:  # all at once, then wait, so that they exit in parallel
        w.stop(graceful=True)
    for w in workers:
        w.reap()


class WorkerGroup:
    """``n`` envs built from ``spec``, split in contiguous slices over ``workers`` processes.

    Args:
        spec: How each env is built (in the workers).
        n: Number of envs; index ``i`` lives on worker ``i * workers // n`` or so.
        workers: Number of processes (at most ``n``).
        timeout: Seconds a worker may take to answer one call, i.e. to run its whole slice
            of that call; ``None`` waits forever. Start-up has its own ``START_TIMEOUT``.
    """

    def __init__(self, spec: EnvSpec, n: int, workers: int, timeout: float | None = 60.0) -> None:
        if not 1 <= workers <= n:
            raise ValueError(f"WorkerGroup needs 1 <= workers <= n, got workers={workers}, n={n}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"step_timeout must be > 0 seconds or None, got {timeout}")
        try:
            pickle.dumps(spec)
        except Exception as exc:
            raise ValueError(f"env workers get the env factory by name, and {spec.factory!r} cannot "
                             f"be pickled ({exc}); use a module-level function or class") from exc
        self.n, self.timeout, self.restarts = n, timeout, 0
        bounds = [n * k // workers for k in range(workers + 1)]
        context = multiprocessing.get_context("spawn")
        self._workers = [_Worker(context, spec, list(range(bounds[k], bounds[k + 1])))
                         for k in range(workers)]
        self._owner = [k for k in range(workers) for _ in range(bounds[k], bounds[k + 1])]
        # Closes the workers when the group is garbage-collected or at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)
        errors = self._await_ready(self._workers)
        if errors:
            self.close()
            raise RuntimeError(f"env workers failed to start: {next(iter(errors.values()))}")
        self.penalties = {i: p for w in self._workers for i, p in w.penalties.items()}
        self.worlds = {i: world for w in self._workers for i, world in w.worlds.items()}

    def pid(self, i: int) -> int:
        """Process id of the worker that runs env ``i`` now."""
        return int(self._workers[self._owner[i]].process.pid)

    def call(self, method: str, args: dict[int, Any]) -> tuple[dict[int, Any], dict[int, str]]:
        """Run ``method`` on the envs named, one message per worker, all workers at once.

        Returns values and failure reasons like ``apply``; the failures also name every env
        of a worker that was restarted during the call, whether it was called or not.
        """
        parts: dict[int, dict[int, Any]] = {}
        for i, arg in args.items():
            parts.setdefault(self._owner[i], {})[i] = arg
        values: dict[int, Any] = {}
        failures: dict[int, str] = {}
        targets = [self._workers[k] for k in parts]
        for w, why in self._await_ready([w for w in targets if not w.ready]).items():
            self._restart(w, why, failures)
        pending: dict[Connection, _Worker] = {}
        for k, part in parts.items():
            w = self._workers[k]
            if not w.ready:  # restarted just now; its envs are already among the failures
                continue
            try:
                w.conn.send((method, part))
            except OSError:
                self._restart(w, w.death(), failures)
                continue
            pending[w.conn] = w
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            answered = wait(list(pending), left)
            if not answered:
                break
            for conn in answered:
                w = pending.pop(conn)  # type: ignore[arg-type]
                try:
                    got, errors = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    self._restart(w, w.death(), failures)
                    continue
                values.update(got)
                failures.update(errors)
        for w in pending.values():
            self._restart(w, f"worker {w.process.pid} did not answer {method} within "
                             f"{self.timeout:g} s", failures)
        return values, failures

    def close(self) -> None:
        """Stop every worker; idempotent."""
        self._finalizer()

    def _await_ready(self, workers: Sequence[_Worker]) -> dict[_Worker, str]:
        """Wait for the start-up messages of ``workers``; returns why each one that failed did."""
        errors: dict[_Worker, str] = {}
        waiting = {w.conn: w for w in workers}
        deadline = time.monotonic() + START_TIMEOUT
        while waiting:
            answered = wait(list(waiting), max(0.0, deadline - time.monotonic()))
            if not answered:
                break
            for conn in answered:
                w = waiting.pop(conn)  # type: ignore[arg-type]
                why = w.take_ready()
                if why:
                    errors[w] = why
        for w in waiting.values():
            errors[w] = f"worker {w.process.pid} did not start within {START_TIMEOUT:g} s"
        return errors

    def _restart(self, w: _Worker, why: str, failures: dict[int, str]) -> None:
        logger.warning("restarting env worker (envs %s): %s", w.indices, why)
        w.stop(graceful=False)
        w.reap()
        w.start()  # its envs are rebuilt while the caller goes on; the next call waits for it
        self.restarts += 1
        failures.update({i: why for i in w.indices})
