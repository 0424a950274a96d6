"""The joint module: one LM with planner and executor adapters, and the skill bank.

One training step (manual optimization, because the two policies run the shared LM with
different adapters, each forward needing its own backward):

    batch of trajectories (from the DataModule's rollouts with the current policy)
      -> group-normalised advantages per role
      -> for each of ``updates_per_batch`` optimizer steps, per role, per micro-batch:
         recompute log-probs of the recorded token ids, clipped turn-level loss + KL,
         backward
      -> one optimizer step over three param groups (planner, executor, query adapter)
      -> bank update: skills from successful episodes, utilities of the skills used

The ``__init__`` signature is the config: LightningCLI turns it into YAML and ``--help``.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torchmetrics import MeanMetric, MetricCollection

from hieragent.agents.policy import Executor, Mode, Planner
from hieragent.memory.bank import MemoryBank
from hieragent.memory.settings import MemorySettings
from hieragent.models.loading import load_causal_lm, load_tokenizer
from hieragent.models.lora import LoraSettings, add_adapters, adapter_parameters
from hieragent.objectives.advantages import assign_advantages
from hieragent.objectives.update import ObjectiveSettings, chunk_loss, count_tokens
from hieragent.rollout.loop import RolloutSettings, collect
from hieragent.types import Batch, Trajectory, Turn

TRAINABLE_MARKERS = ("lora_", "planner.query_adapter.")


def episode_metrics() -> MetricCollection:
    return MetricCollection({"success": MeanMetric(), "return": MeanMetric(), "length": MeanMetric(),
                             "invalid": MeanMetric()})


class HierAgentModule(L.LightningModule):
    """Planner, executor and memory bank, trained jointly with turn-level clipped IS.

    Args:
        model: Base causal LM: ``smollm2`` (offline package), ``tiny`` (random, for
            tests), a local path, or a Hugging Face id already in the local cache.
        model_seed: Initialisation seed of the ``tiny`` preset.
        lora: LoRA hyper-parameters, shared by both adapters.
        planner_mode: ``score`` (softmax over grounded subgoals) or ``generate``.
        executor_mode: ``score`` (softmax over primitive actions) or ``generate``.
        temperature: Sampling temperature of both policies.
        score_reduction: Score mode: ``sum`` (GLAM) or ``mean`` of candidate token log-probs.
        rollout: How episodes are played (hierarchy, subgoal budget, retrieval).
        objective: The clipped turn-level objective and its optimisation.
        memory: The skill bank.
        lr_planner: Learning rate of the planner adapter.
        lr_executor: Learning rate of the executor adapter.
        lr_query: Learning rate of the memory query adapter.
        weight_decay: AdamW weight decay for every group.
    """

    def __init__(
        self,
        model: str = "smollm2",
        model_seed: int = 0,
        lora: LoraSettings = LoraSettings(),
        planner_mode: Mode = "score",
        executor_mode: Mode = "score",
        temperature: float = 1.0,
        score_reduction: str = "sum",
        rollout: RolloutSettings = RolloutSettings(),
        objective: ObjectiveSettings = ObjectiveSettings(),
        memory: MemorySettings = MemorySettings(),
        lr_planner: float = 1e-4,
        lr_executor: float = 1e-4,
        lr_query: float = 1e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        # checkpoints hold the adapters only, not the frozen base model
        self.strict_loading = False
        self.rollout_settings, self.objective, self.memory_settings = rollout, objective, memory
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
            self.bank = MemoryBank(memory.embedder, memory.capacity, memory.merge_threshold)
            if memory.seed_file:
                self.bank.seed_from_jsonl(_resolve_data(memory.seed_file))

        self.train_metrics = episode_metrics().clone(prefix="train/")
        self.val_metrics = episode_metrics().clone(prefix="val/")
        self.test_metrics = episode_metrics().clone(prefix="test/")

    # -- policies ----------------------------------------------------------------------
    def policies(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = [("executor", self.executor)]
        if self.planner is not None:
            out.insert(0, ("planner", self.planner))
        return out

    @torch.no_grad()
    def collect(self, pool, seeds: list[int], groups: list[int], greedy: bool = False,
                generator: torch.Generator | None = None, on_step=None) -> Batch:
        """Roll out the current policies; the DataModule calls this for its batches."""
        was_training = self.lm.training
        self.lm.eval()
        try:
            trajectories = collect(pool, seeds, groups, self.executor, self.planner, self.bank,
                                   self.rollout_settings, greedy, self.global_step, generator,
                                   on_step)
        finally:
            self.lm.train(was_training)
        return Batch(trajectories, policy_version=self.global_step)

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
        return torch.optim.AdamW(groups, weight_decay=self.hparams.weight_decay)

    def training_step(self, dataloader_iter) -> None:
        # taking the batch here, not as an argument, keeps the rollout on the current
        # weights: Lightning would otherwise prefetch it one optimizer step early
        batch: Batch = next(dataloader_iter)[0]
        self._episodes = len(batch.trajectories)
        assign_advantages(batch, self.objective.gamma, self.objective.scale_by_std)
        for _ in range(self.objective.updates_per_batch):
            self._update(batch)
        self._log_episodes(batch.trajectories, self.train_metrics)
        self._update_bank(batch)

    def _update(self, batch: Batch) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        stats: dict[str, float] = {}
        finite = True
        for role, policy in self.policies():
            turns = self._minibatch(batch.turns(role))
            if not turns:
                continue
            denominator = count_tokens(turns)
            sums = {"policy": 0.0, "kl": 0.0, "clipped": 0, "tokens": 0, "ratio": 0.0}
            rmax, rmin = 0.0, math.inf
            size = self.objective.micro_batch_turns
            for start in range(0, len(turns), size):
                chunk = turns[start:start + size]
                ref = policy.reference_logprobs(chunk) if self.objective.kl_coef > 0 else None
                part = chunk_loss(policy.turn_logprobs(chunk), ref, chunk, self.objective, denominator)
                if not torch.isfinite(part.loss):
                    finite = False
                    break
                self.manual_backward(part.loss)
                sums["policy"] += part.policy_sum
                sums["kl"] += part.kl_sum
                sums["clipped"] += part.clipped
                sums["tokens"] += part.tokens
                sums["ratio"] += part.ratio_sum
                rmax, rmin = max(rmax, part.ratio_max), min(rmin, part.ratio_min)
            n = max(sums["tokens"], 1)
            stats.update({f"{role}/loss": sums["policy"] / n, f"{role}/kl": sums["kl"] / n,
                          f"{role}/clip_frac": sums["clipped"] / n,
                          f"{role}/ratio_mean": sums["ratio"] / n, f"{role}/ratio_max": rmax,
                          f"{role}/ratio_min": rmin if rmin < math.inf else 1.0,
                          f"{role}/turns": float(len(turns))})
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(
            params, self.objective.max_grad_norm if self.objective.max_grad_norm > 0 else math.inf
        ) if params else torch.zeros(())
        if finite and torch.isfinite(grad_norm):
            opt.step()
            stats["train/skipped_step"] = 0.0
        else:
            # a NaN or inf never reaches the weights or the optimizer state
            opt.zero_grad()
            stats["train/skipped_step"] = 1.0
        stats["train/grad_norm"] = float(grad_norm)
        self.log_dict(stats, on_step=True, on_epoch=False, batch_size=self._episodes)

    def _minibatch(self, turns: list[Turn]) -> list[Turn]:
        size = self.objective.minibatch_turns
        if size is None or len(turns) <= size:
            return turns
        picks = torch.randperm(len(turns))[:size].tolist()
        return [turns[i] for i in sorted(picks)]

    def _update_bank(self, batch: Batch) -> None:
        if self.bank is None:
            return
        before = dict(self.bank.events) if hasattr(self.bank, "events") else {}
        for trajectory in batch.trajectories:
            used = sorted({e for t in trajectory.of("planner") if t.retrieval is not None
                           for e in (t.retrieval.entry_ids[c] for c in t.retrieval.chosen)})
            if used:
                self.bank.record_use(used, trajectory.env_return)
        if self.memory_settings.add_skills:
            texts = [skill_text(t) for t in batch.trajectories if t.success and t.of("planner")]
            if texts:
                self.bank.add(texts, kind="skill", source="rollout", step=self.global_step)
        after = dict(self.bank.events) if hasattr(self.bank, "events") else {}
        logged = {f"bank/{k}": float(after.get(k, 0) - before.get(k, 0)) for k in after}
        logged["bank/size"] = float(len(self.bank))
        self.log_dict(logged, on_step=True, on_epoch=False, batch_size=self._episodes)

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
            self.log_dict(metrics, on_step=False, on_epoch=True, batch_size=len(trajectories))

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._log_episodes(batch.trajectories, self.val_metrics, on_step=False)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._log_episodes(batch.trajectories, self.test_metrics, on_step=False)

    # -- checkpoints -------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["state_dict"]
        for key in [k for k in state if not any(m in k for m in TRAINABLE_MARKERS)]:
            del state[key]
        checkpoint["hieragent"] = {
            "bank": self.bank.state_dict() if self.bank is not None else None,
            "rng": {"torch": torch.get_rng_state(), "numpy": _numpy_state(),
                    "python": list(random.getstate()[1]), "python_pos": random.getstate()[2]},
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        expected = {k for k in self.state_dict() if any(m in k for m in TRAINABLE_MARKERS)}
        missing = sorted(expected - set(checkpoint.get("state_dict", {})))
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} adapter weights this model expects "
                             f"(first: {missing[0]}); was it written with another model or lora "
                             "config?")
        extra = checkpoint.get("hieragent", {})
        if self.bank is not None and extra.get("bank") is not None:
            self.bank.load_state_dict(extra["bank"])
        rng = extra.get("rng")
        if rng:
            torch.set_rng_state(rng["torch"])
            np.random.set_state(_numpy_restore(rng["numpy"]))
            random.setstate((3, tuple(rng["python"]), rng["python_pos"]))


def skill_text(trajectory: Trajectory) -> str:
    """A skill distilled from a successful episode: its mission and its subgoal sequence."""
    plan = [t.text for t in trajectory.of("planner")]
    return f"mission: {trajectory.mission}. plan: {', '.join(plan)}"


def _numpy_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def _numpy_restore(state: dict[str, Any]) -> tuple:
    return (state["name"], state["keys"].numpy().astype(np.uint32), state["pos"],
            state["has_gauss"], state["gauss"])


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
