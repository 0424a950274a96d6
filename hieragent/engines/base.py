"""The acting engine: the one seam between rollouts and the models, token ids in and out.

Rollout, evaluation and the warm start never call the LM to act; they hand an engine
``Request``s and get back token ids and log-probabilities:

* ``generate``: sampled completions, with the log-probability of every sampled token under
  the distribution it was sampled from (temperature included) and a finish reason;
* ``score``: per-token log-probabilities of given continuations after each request's prompt
  (the candidate scoring of ``score`` mode).

After each optimizer step the trainer calls ``sync(params, version)``. The engine keeps
the weights of the last ``lag + 1`` versions and, inside ``lagged()``, serves the oldest
of them: replay's ``rollout_lag`` is an engine serving an older policy, as an asynchronous
actor would, and every ``Turn`` records the version it was served by.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Iterator, Literal

import torch
from torch import Tensor

from hieragent.sampling import Randomness

FinishReason = Literal["stop", "length"]


@dataclass
class EngineSettings:
    """Settings of the acting engine (``model.engine_settings``).

    Attributes:
        prefix_cache: HF engine: keep each episode's KV in place across calls and reuse the
            longest prompt prefix computed before under the same adapter and version (the
            system text and mission within an episode, the whole history with
            ``rollout.history``); off, every call runs its prompts whole.
        cache_prompts: HF engine: slots of ended episodes whose KV stays available for
            prefix reuse by new episodes, per adapter and version, besides the live ones.
        gpu_memory_utilization: vLLM: fraction of GPU memory the engine may take.
        sleep: vLLM: release the engine's GPU memory while the trainer updates (sleep mode).
        max_model_len: vLLM: the longest prompt plus completion, in tokens.
        tis_cap: vLLM: the truncated-IS cap used when ``objective.tis_cap`` is unset, since
            the engine's log-probs differ from the trainer's at equal weights.
    """

    prefix_cache: bool = True
    cache_prompts: int = 8
    gpu_memory_utilization: float = 0.5
    sleep: bool = True
    max_model_len: int = 4096
    tis_cap: float = 2.0

    def __post_init__(self) -> None:
        if self.cache_prompts < 0:
            raise ValueError(f"model.engine_settings.cache_prompts must be >= 0, got {self.cache_prompts}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("model.engine_settings.gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.tis_cap <= 1.0:
            raise ValueError(f"model.engine_settings.tis_cap must be > 1, got {self.tis_cap}")


@dataclass
class Sampling:
    """How one batch of requests is decoded (``generate``)."""

    temperature: float = 1.0
    max_new_tokens: int = 12
    greedy: bool = False


@dataclass
class Request:
    """One prompt for the engine.

    Attributes:
        prompt_ids: The prompt's token ids (chat template applied: ``engines.prompting``).
        adapter: The LoRA adapter to run it with (``planner`` or ``executor``).
        episode: The env episode it belongs to, e.g. ``(env index, seed)``: its next prompt
            usually extends this one, so the engine keeps its KV cache for it.
        sampling: Decoding settings (``generate`` only).
    """

    prompt_ids: list[int]
    adapter: str
    episode: Hashable | None = None
    sampling: Sampling = field(default_factory=Sampling)


@dataclass
class Generation:
    """One sampled completion: ``ids`` with their ``logprobs`` as sampled, and why it ended."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


class Engine:
    """Base class: version bookkeeping; subclasses implement ``generate`` and ``score``.

    Args:
        settings: Engine settings.
        lag: How many versions behind the latest the weights served inside ``lagged()``
            are (``replay.rollout_lag`` times ``replay.updates_per_batch``).
    """

    name = "base"

    def __init__(self, settings: EngineSettings, lag: int = 0) -> None:
        if lag < 0:
            raise ValueError(f"engine lag must be >= 0, got {lag}")
        self.settings = settings
        self.lag = lag
        # (version, snapshot of the trainable weights or None when lag == 0), oldest first
        self._versions: deque[tuple[int, dict[str, Tensor] | None]] = deque(maxlen=lag + 1)
        self._params: dict[str, Tensor] = {}
        self._served: int | None = None

    # -- versions ----------------------------------------------------------------------
    @property
    def latest_version(self) -> int:
        return self._versions[-1][0] if self._versions else 0

    @property
    def version(self) -> int:
        """The version acting runs on now: the lagged one inside ``lagged()``, else the latest."""
        return self.latest_version if self._served is None else self._served

    @property
    def serving_lagged(self) -> bool:
        """Inside ``lagged()``: the live weights hold the served (lagged) version."""
        return self._served is not None

    @property
    def versions(self) -> list[int]:
        """The versions kept, oldest first."""
        return [v for v, _ in self._versions]

    def sync(self, params: dict[str, Tensor], version: int) -> None:
        """The trainer's weights ``params`` (its live trainable tensors) are now ``version``.

        Called after every optimizer step that changed them, and at the start of a fit,
        validation or test. Syncing the latest version again (weights reloaded under the
        same step) replaces it.
        """
        if self._served is not None:
            raise RuntimeError("engine.sync inside engine.lagged(): the live weights are the lagged ones")
        if self._versions and version < self._versions[-1][0]:
            raise ValueError(f"engine.sync: version {version} is older than the latest synced, "
                             f"{self._versions[-1][0]}")
        if self._versions and version == self._versions[-1][0]:
            self._versions.pop()
        snapshot = {n: p.detach().clone() for n, p in params.items()} if self.lag > 0 else None
        self._versions.append((version, snapshot))
        self._params = params
        self.on_sync(version)

    def on_sync(self, version: int) -> None:
        """Subclass hook: drop caches of versions no longer kept, reload adapters."""

    @contextlib.contextmanager
    def lagged(self) -> Iterator[int]:
        """Serve the oldest kept version inside the block; yields it.

        The trainer's live weights hold that version's values inside, so its own
        recomputation of the behaviour log-probs (truncated IS) runs at the weights that
        acted; they are restored on exit. Early in a run fewer than ``lag`` versions exist
        and the oldest available is served.
        """
        if not self._versions:
            yield self.version
            return
        version, snapshot = self._versions[0]
        if snapshot is None or version == self.latest_version:
            self._served = version
            try:
                yield version
            finally:
                self._served = None
            return
        current = {n: p.detach().clone() for n, p in self._params.items()}
        with torch.no_grad():
            for n, p in self._params.items():
                p.copy_(snapshot[n])
        self._served = version
        try:
            yield version
        finally:
            self._served = None
            with torch.no_grad():
                for n, p in self._params.items():
                    p.copy_(current[n])

    # -- acting ------------------------------------------------------------------------
    def generate(self, requests: list[Request], generator: Randomness = None) -> list[Generation]:
        raise NotImplementedError

    def score(self, requests: list[Request], continuations: list[list[list[int]]]) -> list[list[Tensor]]:
        """Per-token log-probabilities (temperature 1) of each request's continuations.

        Returns, per request, one float32 tensor per continuation, of its length.
        """
        raise NotImplementedError

    def end_episodes(self, episodes: list[Hashable]) -> None:
        """The episodes are over: caches kept for them may go."""

    def sleep(self) -> None:
        """The trainer is about to update: free what acting holds that training needs."""

    def wake(self) -> None:
        """Acting resumes after ``sleep``."""


def one_adapter(requests: list[Request]) -> str:
    """The adapter all ``requests`` share; a batch runs one adapter."""
    adapters = {r.adapter for r in requests}
    if len(adapters) != 1:
        raise ValueError(f"an engine batch runs one adapter; got {sorted(adapters)}")
    return adapters.pop()


def one_sampling(requests: list[Request]) -> tuple[str, Sampling]:
    """The adapter and the ``Sampling`` all ``requests`` share: a generate batch has one of each."""
    adapter, sampling = one_adapter(requests), requests[0].sampling
    if any(r.sampling != sampling for r in requests):
        raise ValueError("an engine batch samples with one Sampling; got several")
    return adapter, sampling


def check_continuations(continuations: list[list[list[int]]]) -> None:
    """``score`` needs at least one continuation per request, none of them empty."""
    if any(not cands for cands in continuations) or any(not c for cands in continuations for c in cands):
        raise ValueError("engine.score: every request needs at least one non-empty continuation")


def per_request(flat: list, continuations: list[list[list[int]]]) -> list[list]:
    """``flat`` (one item per continuation, request by request) grouped per request."""
    out, start = [], 0
    for cands in continuations:
        out.append(flat[start:start + len(cands)])
        start += len(cands)
    return out


def finished(ids: list[int], logprobs: list[float], eos_id: int) -> Generation:
    """A completion cut after its first ``eos_id`` (``stop``), or whole (``length``)."""
    if eos_id in ids:
        end = ids.index(eos_id) + 1
        return Generation(ids[:end], logprobs[:end], "stop")
    return Generation(ids, logprobs, "length")
