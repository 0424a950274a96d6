"""The planner and executor policies: LightningModules over one shared, adapter-switched LM.

A policy is a role's configuration (adapter, action mode, temperature) and its training
side: it recomputes, under the current weights, the log-probabilities of exactly the token
ids recorded at rollout time. Acting goes through an engine (``hieragent.engines``), which
builds the turns with ``engines.acting.act``; prompts are built in ``engines.prompting``.

The shared LM is owned by the joint module (``hieragent.lightning.module``) and *bound*
here without being registered, so its weights appear once in the checkpoint.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Literal

import lightning as L
import torch
from torch import Tensor

from hieragent.agents.scoring import candidate_logprobs, continuation_logprobs
from hieragent.memory.adapter import QueryAdapter
from hieragent.memory.retrieval import retrieval_logprob
from hieragent.types import Role, Turn

Mode = Literal["score", "generate"]


class Policy(L.LightningModule):
    """One role's policy: an adapter name, an action mode and a sampling temperature.

    Args:
        adapter: Name of this policy's LoRA adapter on the shared LM.
        mode: ``score`` (softmax over candidates) or ``generate`` (free text, parsed).
        temperature: Sampling temperature (score mode: of the candidate softmax).
        max_new_tokens: Generate mode: the most tokens one turn may produce.
        score_reduction: Score mode: a candidate's score is the ``sum`` (GLAM) or the
            ``mean`` of its token log-probabilities.
    """

    role: Role = "executor"

    def __init__(self, adapter: str, mode: Mode = "score", temperature: float = 1.0,
                 max_new_tokens: int = 12, score_reduction: str = "sum") -> None:
        super().__init__()
        if score_reduction not in ("sum", "mean"):
            raise ValueError(f"score_reduction must be 'sum' or 'mean', got {score_reduction!r}")
        self.score_reduction = score_reduction
        if mode not in ("score", "generate"):
            raise ValueError(f"{self.role}.mode must be 'score' or 'generate', got {mode!r}")
        if temperature <= 0:
            raise ValueError(f"{self.role}.temperature must be > 0, got {temperature}")
        self.adapter = adapter
        self.mode = mode
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self._candidate_cache: dict[str, list[int]] = {}
        self.reference_adapter: str | None = None  # None: the base model is the reference

    def bind(self, lm: torch.nn.Module, tokenizer) -> None:
        # a plain attribute, not a submodule: the joint module owns the LM's parameters
        self.__dict__["lm"] = lm
        self.__dict__["tokenizer"] = tokenizer

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the shared LM with this policy's adapter."""
        if hasattr(self.lm, "set_adapter"):
            self.lm.set_adapter(self.adapter)
        yield

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Run the shared LM as the reference policy: the frozen ``reference_adapter`` if one
        is set (after a warm start), else the base model with adapters disabled."""
        if self.reference_adapter is not None:
            self.lm.set_adapter(self.reference_adapter, inference_mode=True)
            try:
                yield
            finally:
                self.lm.set_adapter(self.adapter)
            return
        with self.lm.disable_adapter() if hasattr(self.lm, "disable_adapter") else contextlib.nullcontext():
            yield

    # -- token ids ---------------------------------------------------------------------
    def candidate_ids(self, text: str) -> list[int]:
        """A candidate is scored as a complete reply: its tokens and the end-of-turn token."""
        if text not in self._candidate_cache:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            self._candidate_cache[text] = list(ids) + [self.tokenizer.eos_token_id]
        return self._candidate_cache[text]

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    # -- training ----------------------------------------------------------------------
    def turn_logprobs(self, turns: list[Turn]) -> list[Tensor]:
        """Per-"token" log-probabilities of recorded turns under the current weights.

        Score mode gives one entry per turn (the chosen candidate's softmax log-prob);
        generate mode one entry per generated token. Aligned with ``Turn.old_logprobs``.
        """
        with self.active():
            return self._recorded_logprobs(turns)

    @torch.no_grad()
    def reference_logprobs(self, turns: list[Turn]) -> list[Tensor]:
        with self.reference():
            return self._recorded_logprobs(turns)

    def _recorded_logprobs(self, turns: list[Turn]) -> list[Tensor]:
        prompts = [t.prompt_ids for t in turns]
        if self.mode == "score":
            logps = candidate_logprobs(self.lm, prompts, [t.candidate_ids for t in turns],
                                       self.pad_id, self.temperature, self.score_reduction)
            return [lp[t.chosen:t.chosen + 1] for lp, t in zip(logps, turns)]
        actions = [t.action_ids if t.action_ids else [self.tokenizer.eos_token_id] for t in turns]
        per_token = continuation_logprobs(self.lm, prompts, actions, list(range(len(turns))), self.pad_id,
                                          self.temperature)
        # an empty generation still ran one forward: keep the shapes, drop its entry
        return [lp if t.action_ids else lp[:0] for lp, t in zip(per_token, turns)]


class Executor(Policy):
    """Turns a subgoal and the current view into a primitive action."""

    role: Role = "executor"

    def __init__(self, adapter: str = "executor", mode: Mode = "score", temperature: float = 1.0,
                 max_new_tokens: int = 8, score_reduction: str = "sum") -> None:
        super().__init__(adapter, mode, temperature, max_new_tokens, score_reduction)


class Planner(Policy):
    """Writes subgoals from the mission, the view and retrieved skills.

    It owns the memory's query adapter: the retrieval is part of the planner's turn and gets
    the turn's advantage, with a ratio and a clip of its own (``objectives.update.retrieval_loss``).

    Args:
        embed_dim: Dimension of the memory encoder's embeddings (the adapter's width).
    """

    role: Role = "planner"

    def __init__(self, adapter: str = "planner", mode: Mode = "score", temperature: float = 1.0,
                 max_new_tokens: int = 12, score_reduction: str = "sum", embed_dim: int = 384) -> None:
        super().__init__(adapter, mode, temperature, max_new_tokens, score_reduction)
        self.query_adapter = QueryAdapter(embed_dim)

    def retrieval_logprobs(self, turns: list[Turn]) -> Tensor:
        """Log-probability of each turn's recorded retrieval under the current query adapter. ``[R]``"""
        return retrieval_logprob(self.query_adapter, [t.retrieval for t in turns])
