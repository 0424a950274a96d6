"""The joint module: one LM with planner and executor adapters, and the skill bank.

One training step (manual optimization, because the two policies run the shared LM with
different adapters, each forward needing its own backward):

    batch of trajectories (from the DataModule's rollouts with the current policy)
      -> (KL as reward) -> advantages per role (GRPO, RLOO, GiGPO or GAE)
      -> into the replay buffer; batches older than ``max_staleness`` are dropped
      -> for each of ``updates_per_batch`` optimizer steps, per role, per micro-batch:
         recompute log-probs of the recorded token ids, clipped loss + KL, backward
         (the planner's retrieval: its own clipped term, on the query adapter)
      -> one optimizer step over the param groups (planner, executor, query adapter, value
         head), each clipped by its own norm; the clipping-triggered normalization scales
         a group's learning rate for the step (``lightning/optim.py``); a non-finite loss or
         gradient skips the step, leaves weights and state alone and drops its batch
      -> bank update (``memory/evolution.py``): utilities of the entries used, skills from
         successful episodes, lessons from failed ones, merge and evict; every change is
         appended to ``<log_dir>/bank_changes.jsonl``

Across processes (``trainer.strategy: ddp``, ``strategies.RolloutDDPStrategy``) each rank
rolls out its own whole groups, so group-normalised advantages are exact per rank. The
losses are normalised by the counts summed over ranks and the gradients summed once per
optimizer step (``lightning/distributed.py``), so the ranks take the step one process takes
on all their episodes, and a skip is decided for all together. Every rank receives every
rank's episodes and applies the same bank evolution to them, so the banks stay identical
without a broadcast; rank 0 writes the change log and the checkpoints.

The ``__init__`` signature is the config: LightningCLI turns it into YAML and ``--help``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from torchmetrics import MeanMetric, MetricCollection

from hieragent.agents.policy import Executor, Mode, Planner
from hieragent.engines import ENGINES
from hieragent.engines.acting import Agent
from hieragent.engines.base import Engine, EngineSettings
from hieragent.engines.hf import HFEngine
from hieragent.engines.prompting import Prompter
from hieragent.precision import autocast_dtype
from hieragent.memory.bank import MemoryBank
from hieragent.memory.evolution import BankEvolution, append_changes
from hieragent.memory.retrieval import contrastive_loss
from hieragent.memory.settings import MemorySettings
from hieragent.models.loading import load_causal_lm, load_tokenizer
from hieragent.models.lora import LoraSettings, add_adapters, add_reference_adapters, adapter_parameters
from hieragent.lightning.distributed import all_sum, distributed, gather_objects, log_dir, world
from hieragent.lightning.offpolicy import record_trainer_logprobs, subtract_kl_reward
from hieragent.objectives.advantages import AdvantageSettings, assign_advantages
from hieragent.objectives.update import (ObjectiveSettings, normaliser, retrieval_count, retrieval_loss,
                                         role_loss, role_turns, sample_minibatch)
from hieragent.objectives.value import TurnValueHead, turn_features, value_loss, value_targets
from hieragent.memory.encoder import embedding_dim, load_encoder
from hieragent.rollout.loop import RolloutSettings, collect
from hieragent.rollout.replay import ReplayBuffer, ReplaySettings, staleness
from hieragent.lightning.optim import agree_on_step, guarded_step
from hieragent.lightning.state import TRAINABLE_MARKERS, CheckpointHooks
from hieragent.lightning.warmstart import imitation_step
from hieragent.types import Batch, Demonstration, Trajectory, Turn

log = logging.getLogger(__name__)

def episode_metrics() -> MetricCollection:
    return MetricCollection({"success": MeanMetric(), "return": MeanMetric(), "length": MeanMetric(),
                             "invalid": MeanMetric()})


class HierAgentModule(CheckpointHooks, L.LightningModule):
    """Planner, executor and memory bank, trained jointly with turn-level clipped IS.

    Args:
        model: Base causal LM: ``smollm2`` (offline package), ``tiny`` (random, for
            tests), a local path, or a Hugging Face id already in the local cache.
        model_seed: Initialisation seed of the ``tiny`` preset.
        engine: The acting engine: ``hf`` (transformers on the trainer's own LM, CPU or
            GPU; prefix and history KV cache) or ``vllm`` (a colocated vLLM engine on a CUDA
            GPU with both LoRA adapters; the extra ``hieragent[vllm]``). Rollouts and
            evaluation act through it; the trainer syncs it after every optimizer step.
        engine_settings: The engine's settings (cache, vLLM memory and sleep).
        lora: LoRA hyper-parameters, shared by both adapters.
        planner_mode: ``score`` (softmax over grounded subgoals) or ``generate``.
        executor_mode: ``score`` (softmax over primitive actions) or ``generate``.
        temperature: Sampling temperature of both policies.
        score_reduction: Score mode: ``sum`` (GLAM) or ``mean`` of candidate token log-probs.
        rollout: How episodes are played (hierarchy, subgoal budget, retrieval).
        objective: The clipped turn-level objective and its optimisation.
        advantage: How turn credits become advantages.
        replay: Reuse of rollouts across updates: updates per batch, staleness, lag.
        memory: The skill bank.
        lr_planner: Learning rate of the planner adapter.
        lr_executor: Learning rate of the executor adapter.
        lr_query: Learning rate of the memory query adapter.
        lr_value: Learning rate of the turn value head (``advantage.estimator: gae`` only).
        weight_decay: AdamW weight decay for every group.
        init_from: A checkpoint (of a warm-start run, say) whose adapters, query adapter
            and bank this run starts from; its step, optimizer and RNG are not taken.
            ``--ckpt_path`` is for resuming the same run instead.
        kl_reference: The KL's reference policy. ``init``: the policy this run starts from,
            so after ``init_from`` a frozen copy of the warm-start adapters (as in GLIDER and
            RLHF pipelines: RL must not pull back to the model before SFT), and the base
            model otherwise (fresh LoRA adapters start as the base model). ``base``: always
            the base model with adapters disabled.
    """

    def __init__(
        self,
        model: str = "smollm2",
        model_seed: int = 0,
        engine: Literal["hf", "vllm"] = "hf",
        engine_settings: EngineSettings = EngineSettings(),
        lora: LoraSettings = LoraSettings(),
        planner_mode: Mode = "score",
        executor_mode: Mode = "score",
        temperature: float = 1.0,
        score_reduction: str = "sum",
        rollout: RolloutSettings = RolloutSettings(),
        objective: ObjectiveSettings = ObjectiveSettings(),
        advantage: AdvantageSettings = AdvantageSettings(),
        replay: ReplaySettings = ReplaySettings(),
        memory: MemorySettings = MemorySettings(),
        lr_planner: float = 1e-4,
        lr_executor: float = 1e-4,
        lr_query: float = 1e-3,
        lr_value: float = 1e-3,
        weight_decay: float = 0.0,
        init_from: str | None = None,
        kl_reference: Literal["init", "base"] = "init",
    ) -> None:
        super().__init__()
        if engine not in ENGINES:
            raise ValueError(f"model.engine must be one of {', '.join(ENGINES)}; got {engine!r}")
        if engine == "vllm":  # before anything is loaded or written: no GPU, one line
            from hieragent.engines.vllm import require_vllm
            require_vllm()
            if objective.tis_cap is None:  # the engine's log-probs differ from the trainer's
                objective = dataclasses.replace(objective, tis_cap=engine_settings.tis_cap)
        self.save_hyperparameters()
        self.automatic_optimization = False
        self._skipped_in_a_row = 0
        self.env_steps = 0  # training env steps so far, over every rank (checkpointed)
        # checkpoints hold the adapters only, not the frozen base model
        self.strict_loading = False
        self.rollout_settings, self.objective, self.memory_settings = rollout, objective, memory
        self.advantage, self.replay_settings = advantage, replay
        self.replay = ReplayBuffer(replay.max_staleness, replay.max_batches)
        self.hierarchical = rollout.hierarchical

        roles = ["planner", "executor"] if self.hierarchical else ["executor"]
        self.tokenizer = load_tokenizer(model)
        self.lm = add_adapters(load_causal_lm(model, seed=model_seed), roles, lora)
        self.lm.train()  # from_pretrained returns eval mode; Lightning keeps modes as found
        self.executor = Executor(mode=executor_mode, temperature=temperature,
                                 score_reduction=score_reduction)
        self.executor.bind(self.lm, self.tokenizer)
        self.planner: Planner | None = None
        if self.hierarchical:
            self.planner = Planner(mode=planner_mode, temperature=temperature,
                                   score_reduction=score_reduction)
            self.planner.bind(self.lm, self.tokenizer)
        self.bank: MemoryBank | None = None
        if self.hierarchical and memory.enabled:
            self.bank = MemoryBank(memory.embedder, memory.capacity, memory.merge_threshold, memory.index)
            if memory.seed_file:
                self.bank.seed_from_jsonl(_resolve_data(memory.seed_file))
            self.bank.drain_changes()  # the seed skills are the config, not a change
        self.prompter = Prompter(self.tokenizer, rollout.history)
        self.engine: Engine = self._make_engine(engine, engine_settings, replay, lora)
        self.agent = Agent(self.engine, self.prompter, self.executor, self.planner, self.bank)
        self.evolution = BankEvolution(self.bank, memory) if self.bank is not None else None
        self._contrastive: tuple[list, torch.Tensor] | None = None
        self._skill_keys: np.ndarray | None = None
        self._val_episodes: list[Trajectory] = []

        self.value_head: TurnValueHead | None = None
        if advantage.estimator == "gae":  # ArCHer-style turn critic on frozen state embeddings
            self.value_head = TurnValueHead(embedding_dim(load_encoder(memory.embedder)))
        self._value_batch = None

        if kl_reference not in ("init", "base"):
            raise ValueError(f"model.kl_reference must be 'init' or 'base', got {kl_reference!r}")
        if init_from:
            self.load_weights(init_from)
            if kl_reference == "init":
                refs = dict(zip(roles, add_reference_adapters(self.lm, roles, lora)))
                for role, policy in self.policies():
                    policy.reference_adapter = refs[role]

        self.train_metrics = episode_metrics().clone(prefix="train/")
        self.val_metrics = episode_metrics().clone(prefix="val/")
        self.test_metrics = episode_metrics().clone(prefix="test/")
        self.env_metrics = torch.nn.ModuleDict()  # per-env evaluation metrics, made on first use

    # -- policies ----------------------------------------------------------------------
    def policies(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = [("executor", self.executor)]
        if self.planner is not None:
            out.insert(0, ("planner", self.planner))
        return out

    def _make_engine(self, name: str, settings: EngineSettings, replay: ReplaySettings,
                     lora: LoraSettings) -> Engine:
        # rollout_lag counts training steps; the engine's versions are optimizer steps
        lag = replay.rollout_lag * replay.updates_per_batch
        if name == "vllm":
            from hieragent.engines.vllm import VLLMEngine
            from hieragent.models.loading import cache_dir, smollm2_dir

            model = self.hparams.model
            path = smollm2_dir() if model == "smollm2" else Path(model)
            workdir = cache_dir() / "vllm-adapters" / f"{os.getpid()}-{id(self):x}"
            return VLLMEngine(self.lm, path, self.tokenizer.eos_token_id, workdir, settings, lag,
                              lora_rank=lora.r)
        return HFEngine(self.lm, self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, settings, lag)

    def sync_engine(self) -> None:
        """The engine now serves the weights of this optimizer step (``global_step``)."""
        self.engine.sync(self.trainable_parameters(), self.global_step)

    def _ensure_synced(self) -> None:
        # the first acting of a fit, a resume (whose step is restored after on_fit_start),
        # a validation or a test; during training every optimizer step syncs
        if not self.engine.versions or self.engine.latest_version != self.global_step:
            self.sync_engine()

    @torch.no_grad()
    def collect(self, pool, seeds: list[int], groups: list[int], greedy: bool = False,
                generator: torch.Generator | None = None, on_step=None) -> Batch:
        """Roll out the policies through the engine (evaluation; training: ``collect_train``).
        The batch and its turns carry the version the engine served."""
        if not self.engine.serving_lagged:
            self._ensure_synced()
        was_training = self.lm.training
        self.lm.eval()
        try:
            trajectories = collect(pool, seeds, groups, self.agent, self.rollout_settings, greedy,
                                   generator, on_step)
        finally:
            self.lm.train(was_training)
        return Batch(trajectories, policy_version=self.engine.version)

    def collect_train(self, pool, seeds: list[int], groups: list[int],
                      generator: torch.Generator | list[torch.Generator] | None = None) -> Batch:
        """A training batch from the version the engine serves ``replay.rollout_lag`` steps
        behind, with the trainer's own behaviour log-probs if truncated IS needs them.
        ``generator``: one per episode, or ``None`` for torch's global stream."""
        self._ensure_synced()
        with self.engine.lagged():
            batch = self.collect(pool, seeds, groups, generator=generator)
            if self.objective.tis_cap is not None:
                for role, policy in self.policies():
                    record_trainer_logprobs(policy, batch.turns(role), self.objective.micro_batch_turns)
        return batch

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.named_parameters() if any(m in n for m in TRAINABLE_MARKERS)}

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch  # plain Python data; tensors are built per micro-batch on the LM's device

    # -- optimisation ------------------------------------------------------------------
    def configure_optimizers(self) -> torch.optim.Optimizer:
        groups = [{"params": adapter_parameters(self.lm, "executor"), "lr": self.hparams.lr_executor,
                   "name": "executor"}]
        if self.planner is not None:
            groups.append({"params": adapter_parameters(self.lm, "planner"),
                           "lr": self.hparams.lr_planner, "name": "planner"})
            groups.append({"params": list(self.planner.query_adapter.parameters()),
                           "lr": self.hparams.lr_query, "name": "query_adapter"})
        if self.value_head is not None:
            groups.append({"params": list(self.value_head.parameters()), "lr": self.hparams.lr_value,
                           "name": "value"})
        return torch.optim.AdamW(groups, weight_decay=self.hparams.weight_decay)

    def training_step(self, dataloader_iter) -> None:
        # taking the batch here, not as an argument, keeps the rollout on the current
        # weights: Lightning would otherwise prefetch it one optimizer step early
        batch: Batch | list[Demonstration] = next(dataloader_iter)[0]
        if isinstance(batch, list):  # demonstrations: the supervised warm-start stage
            stats = imitation_step(self, batch)
            for logger in self.loggers:
                logger.log_metrics(stats, step=self.global_step)
            self.log("sft/loss", sum(v for k, v in stats.items() if k.endswith("_nll")),
                     prog_bar=True, on_step=True, batch_size=len(batch))
            return
        self._episodes = max(len(batch.trajectories), 1)
        if self.objective.kl_coef > 0 and self.objective.kl_mode == "reward":
            for role, policy in self.policies():
                penalty = subtract_kl_reward(policy, batch.turns(role), self.objective.kl_coef,
                                             self.objective.kl_estimator, self.objective.micro_batch_turns)
                self.log(f"{role}/kl_reward", penalty, on_step=True, batch_size=self._episodes)
        everyone = self._every_rank(batch)
        self.env_steps += sum(t.length for t in everyone.trajectories)
        self.log("train/env_steps", float(self.env_steps), on_step=True, on_epoch=False,
                 batch_size=self._episodes)
        values = self._values(batch)
        self._prepare_contrastive(everyone, batch)
        assign_advantages(batch, settings=self.advantage, values=values)
        self.replay.add(batch)
        batches = self.replay.retained(self.global_step)
        self.log_dict({"replay/batches": float(len(batches)),
                       "replay/dropped_turns": float(self.replay.dropped_turns)},
                      on_step=True, on_epoch=False, batch_size=self._episodes)
        self.engine.sleep()
        for _ in range(self.replay_settings.updates_per_batch):
            if self._update(batches):  # the batches that caused a skip are gone from the buffer
                batches = self.replay.retained(self.global_step)
        self.engine.wake()
        self._log_episodes(batch.trajectories, self.train_metrics)
        counters = getattr(self.trainer.datamodule, "env_counters", None)
        env_stats = counters() if counters is not None else {}
        env_stats["train/loop_ended"] = (sum(t.loop_ended for t in batch.trajectories)
                                         / max(len(batch.trajectories), 1))
        self.log_dict(env_stats, on_step=True, on_epoch=False, batch_size=self._episodes)
        self._update_bank(everyone)
        self._check_ranks_agree()

    def _check_ranks_agree(self) -> None:
        """Across processes, fail at the first step where the ranks' adapters or banks part.

        They are the same by construction; a difference (bank code that is not deterministic,
        ranks on different hardware) would otherwise grow silently. One small collective: a
        float64 sum of the trainable parameters and the bank's size, capacity and counts.
        """
        if not distributed():
            return
        digest = {"adapters": sum(float(p.detach().double().sum()) for p in self.trainable_parameters().values())}
        if self.bank is not None:
            digest["bank"] = (len(self.bank), self.bank.capacity, sorted(self.bank.events.items()))
        for rank, other in enumerate(gather_objects(digest, "rank agreement")):
            parted = [key for key in digest if other[key] != digest[key]]
            if parted:
                raise RuntimeError(f"after optimizer step {self.global_step}, rank {world()[0]}'s "
                                   f"{' and '.join(parted)} differ from rank {rank}'s ({digest} against "
                                   f"{other}); every rank must hold the same, so training stops here")

    def _every_rank(self, batch: Batch) -> Batch:
        """Every rank's episodes of this step, rank by rank: what the bank evolves on, the same
        on every rank. Other ranks' episodes come as ``Trajectory.summary()`` (no token ids),
        this rank's are its own objects. ``batch`` in one process."""
        if not distributed():
            return batch
        parts = gather_objects([t.summary() for t in batch.trajectories], "episodes for the bank")
        parts[world()[0]] = batch.trajectories
        return Batch([t for part in parts for t in part], policy_version=batch.policy_version)

    def _values(self, batch: Batch) -> torch.Tensor | None:
        """GAE only: the critic's values of the batch's turns, and its regression targets."""
        if self.value_head is None:
            return None
        turns = batch.turns()
        features = turn_features(turns, load_encoder(self.memory_settings.embedder))  # [N, D]
        roles = [t.role for t in turns]
        with torch.no_grad():
            values = self.value_head(features, roles)  # [N]
        targets = value_targets(batch, values, self.advantage.gamma, self.advantage.gae_lambda)
        self._value_batch = (features, roles, targets)
        return values

    def _update(self, batches: list[Batch]) -> str | None:
        """One optimizer step on ``batches``; returns why it was skipped, if it was.

        A skipped step also drops the batches that caused it from the replay buffer: the
        one holding the micro-batch whose loss was not finite, or, for a non-finite gradient
        (which names no batch) or a non-finite loss on another rank, every batch of this
        update. Kept, they would make every later update that reuses them skip too.

        Across processes it meets the other ranks three times (``lightning/distributed.py``):
        the loss normalisers, then the skip, gradient presence and clipping sums, then the
        gradients; in one process these return what they are given.
        """
        opt = self.optimizers()
        opt.zero_grad()
        stats: dict[str, float] = {}
        sums: dict[str, tuple[float, float]] = {}  # loss name -> clipping sums (bias, adv)
        skip: str | None = None  # why this step must not touch the weights
        culprits: list[Turn] = []
        settings, version = self.objective, self.global_step
        plan = [(role, policy, sample_minibatch(role_turns(batches, role), settings.minibatch_turns,
                                                whole_sequences=settings.whole_sequences))
                for role, policy in self.policies()]
        scale = self._loss_scales(plan)
        for role, policy, items in plan:
            if not items.turns:
                continue
            parts = [(role, role_loss(policy, items, settings, self.manual_backward, scale[role]))]
            if role == "planner" and parts[0][1].finite:
                parts.append(("retrieval",
                              retrieval_loss(policy, items, settings, self.manual_backward, scale["retrieval"])))
            for name, role_stats in parts:
                if not role_stats.finite:
                    skip, culprits = f"non-finite {name} loss (log-probs, ratios or advantages)", role_stats.bad_turns
                    break
                if not role_stats.turns:
                    continue
                stats.update(role_stats.logged(name))
                sums[name] = (role_stats.bias_sum, role_stats.adv_sum)
            if skip is not None:
                break
            lags = staleness(items.turns, self.global_step)
            stats[f"{role}/staleness_mean"] = sum(lags) / len(lags)
            stats[f"{role}/staleness_max"] = float(max(lags))
            if settings.tis_cap is not None:
                stats[f"{role}/logprob_gap"] = parts[0][1].gap_sum / max(parts[0][1].tokens, 1)
        if skip is None and self._contrastive is not None:
            retrievals, positives = self._contrastive
            c_loss = contrastive_loss(self.planner.query_adapter, retrievals, positives,
                                      self.memory_settings.contrastive_temperature, self.bank.merge_threshold)
            self.manual_backward(self.memory_settings.contrastive_coef * scale["contrastive"] * c_loss)
            stats["memory/contrastive_loss"] = float(c_loss.detach())
        if skip is None and self._value_batch is not None:
            features, roles, targets = self._value_batch
            v_loss = value_loss(self.value_head(features, roles), targets)
            self.manual_backward(scale["value"] * v_loss)
            stats["value/loss"] = float(v_loss.detach())
        skip, scales = self._agree(opt, skip, sums, stats)
        step = guarded_step(opt, settings.max_grad_norm, scales, skip)
        if step.skipped is None:
            self.sync_engine()
        self._skipped_in_a_row = self._skipped_in_a_row + 1 if step.skipped is not None else 0
        limit = self.objective.max_skipped_steps
        if limit and self._skipped_in_a_row >= limit:
            raise ValueError(f"{self._skipped_in_a_row} optimizer steps in a row were skipped, the last for "
                             f"{step.skipped}; stopping, since no step would ever reach trainer.max_steps "
                             "(model.objective.max_skipped_steps sets the limit; the weights are those of "
                             f"step {self.global_step})")
        if step.skipped is not None:
            log.warning("step %d: %s; the step is skipped", self.global_step, step.skipped)
            bad = {id(t) for t in culprits}
            dropped = [b for b in batches if any(id(t) in bad for t in b.turns())] if bad else batches
            stats["replay/dropped_batches"] = float(self.replay.discard(dropped))
        for group, norm in step.grad_norms.items():
            stats[f"{group}/grad_norm"] = norm
        for group, norm in step.update_norms.items():
            stats[f"{group}/update_norm"] = norm
            stats[f"{group}/lr_scale"] = step.lr_scales[group]
        stats["train/skipped_step"] = float(step.skipped is not None)
        stats["train/grad_norm"] = step.grad_norm
        # straight to the loggers, one row per update: ``self.log`` keeps only the last of
        # several updates in one training step
        for logger in self.loggers:
            logger.log_metrics(stats, step=version)
        return step.skipped

    def _loss_scales(self, plan: list) -> dict[str, float]:
        """Per loss term, this rank's normaliser over the sum of every rank's (1 in one
        process): the planner's and executor's tokens or sequences, the retrievals, the
        contrastive pairs and the value rows."""
        settings = self.objective
        local = {role: float(normaliser(items, settings)) for role, _, items in plan}
        planner = next((items for role, _, items in plan if role == "planner"), None)
        local["retrieval"] = float(retrieval_count(planner, settings)) if planner is not None else 0.0
        local["contrastive"] = float(len(self._contrastive[0])) if self._contrastive is not None else 0.0
        local["value"] = float(len(self._value_batch[2])) if self._value_batch is not None else 0.0
        names = sorted(local)
        total = all_sum([local[n] for n in names], "update counts").tolist()
        return {n: local[n] / t if t > 0 else 0.0 for n, t in zip(names, total)}

    def _agree(self, opt, skip: str | None, sums: dict[str, tuple[float, float]],
               stats: dict[str, float]) -> tuple[str | None, dict[str, float]]:
        return agree_on_step(opt, skip, sums, self.objective.clip_normalization,
                             self.objective.clip_norm_strength, stats)

    def _prepare_contrastive(self, everyone: Batch, own: Batch) -> None:
        """Skill keys for every rank's episodes (the bank's update), contrastive pairs for
        this rank's own (its share of the loss)."""
        self._contrastive = self._skill_keys = None
        if self.evolution is not None:
            mine = None if everyone is own else own.trajectories
            self._skill_keys, self._contrastive = self.evolution.prepare(everyone, mine)

    def _update_bank(self, batch: Batch) -> None:
        if self.evolution is None:
            return
        self._agree_on_index()
        stats, changes = self.evolution.update(batch, self.global_step, self._skill_keys)
        self.bank.lend_index()
        self._skill_keys = None
        self._write_changes(changes)
        self.log_dict({k: v for k, v in stats.items() if not math.isnan(v)},
                      on_step=True, on_epoch=False, batch_size=self._episodes)

    def _agree_on_index(self) -> None:
        """Across processes: swap a background index rebuild in once it has finished on every
        rank, all at this same update, with rank 0's choice where ``auto`` measured differently,
        so that every rank's bank keeps searching, merging and evicting alike. Every rank starts
        a rebuild at the same add (their banks are the same), so all ask here, or none."""
        if not distributed() or self.bank is None or not self.bank.index_building:
            return
        self.bank.swap_index(gather_objects(self.bank.index_vote(), "bank index swap"))

    def _write_changes(self, changes: list[dict[str, Any]]) -> None:
        if self._trainer is not None and self.trainer.is_global_zero and log_dir(self.trainer) is not None:
            append_changes(Path(log_dir(self.trainer)) / "bank_changes.jsonl", changes)

    # -- evaluation --------------------------------------------------------------------
    def _log_episodes(self, trajectories: list[Trajectory], metrics: MetricCollection,
                      on_step: bool = True) -> None:
        for t in trajectories:
            metrics["success"].update(float(t.success))
            metrics["return"].update(t.env_return)
            metrics["length"].update(float(t.length))
            metrics["invalid"].update(t.invalid_actions / max(t.length, 1))
        if on_step:
            self.log_dict(metrics.compute(), on_step=True, on_epoch=False, prog_bar=True,
                          batch_size=len(trajectories))
            metrics.reset()
        else:
            self.log_dict(metrics, on_step=False, on_epoch=True, batch_size=len(trajectories),
                          add_dataloader_idx=False)

    def validation_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._log_episodes(batch.trajectories, self._eval_metrics("val", dataloader_idx), on_step=False)
        self._val_episodes.extend(batch.trajectories)

    def on_validation_epoch_end(self) -> None:
        episodes, self._val_episodes = self._val_episodes, []
        if self.evolution is None or self.trainer.sanity_checking or self.trainer.state.fn != "fit":
            return
        episodes = [t for part in gather_objects([t.summary() for t in episodes], "validation episodes")
                    for t in part]
        if not episodes:
            return
        success = sum(t.success for t in episodes) / len(episodes)
        stats = self.evolution.on_validation(success, [t for t in episodes if not t.success], self.global_step)
        self._write_changes(self.bank.drain_changes())
        self.log_dict(stats, on_step=False, on_epoch=True, batch_size=len(episodes))

    def test_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._log_episodes(batch.trajectories, self._eval_metrics("test", dataloader_idx), on_step=False)

    def setup(self, stage: str) -> None:
        from hieragent.strategies import RolloutDDPStrategy

        if self.trainer.world_size > 1 and not isinstance(self.trainer.strategy, RolloutDDPStrategy):
            raise ValueError(f"trainer.strategy: {type(self.trainer.strategy).__name__} with "
                             f"{self.trainer.world_size} processes; several processes need "
                             "hieragent.strategies.RolloutDDPStrategy (`trainer.strategy: ddp` in the CLI)")
        if isinstance(self.engine, HFEngine):  # act in the precision the trainer computes in
            self.engine.autocast = autocast_dtype(self.trainer.precision)
        if self.bank is not None:  # across processes, index rebuilds swap in where all ranks agree
            self.bank.hold_index_swaps(self.trainer.world_size > 1)
        # per-env metrics exist before anything is logged: Lightning maps metric objects to
        # attribute names once, at the first log call
        envs = getattr(self.trainer.datamodule, "test_envs", None) or []
        if len(envs) > 1:
            for prefix in ("val", "test"):
                for i, name in enumerate(envs):
                    key = f"{prefix}_{i}"
                    if key not in self.env_metrics:
                        self.env_metrics[key] = episode_metrics().clone(prefix=f"{prefix}/{name}/")

    def _eval_metrics(self, stage: str, dataloader_idx: int) -> MetricCollection:
        """``val/success`` for one env; ``val/<env>/success`` per env when ``data.test_envs``
        names several (one dataloader each)."""
        key = f"{stage}_{dataloader_idx}"
        if key in self.env_metrics:
            return self.env_metrics[key]
        return self.val_metrics if stage == "val" else self.test_metrics


def _resolve_data(path: str) -> Path:
    """A data path as given, else relative to the repository that holds this package."""
    candidate = Path(path)
    if candidate.exists():
        return candidate
    repo = Path(__file__).resolve().parents[2] / path
    if repo.exists():
        return repo
    raise FileNotFoundError(f"memory.seed_file '{path}' does not exist (looked in the working "
                            f"directory and in {repo.parent}); set memory.seed_file to a JSONL "
                            "of skills or to '' for an empty bank")
