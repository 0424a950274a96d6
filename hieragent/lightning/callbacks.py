"""Callbacks and plugins: the before/after evaluation table, atomic checkpoint writes and the
frozen heap."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import torch

from hieragent import heap
from hieragent.io import atomic_open, atomic_write_text
from hieragent.lightning.distributed import all_sum, log_dir

def summarise(batches) -> dict[str, float]:
    """Success rate, mean return and mean episode length over evaluation batches; across
    processes, over every rank's episodes (each rank passes its own)."""
    episodes = [t for b in batches for t in b.trajectories]
    n, success, ret, length, invalid = all_sum(
        [len(episodes), sum(t.success for t in episodes), sum(t.env_return for t in episodes),
         sum(t.length for t in episodes), sum(t.invalid_actions for t in episodes)], "evaluation summary").tolist()
    return {
        "episodes": n,
        "success": success / max(n, 1),
        "return": ret / max(n, 1),
        "length": length / max(n, 1),
        "invalid": invalid / max(length, 1),
    }


class BeforeAfterEval(L.Callback):
    """Evaluate on held-out seeds before and after ``fit`` and print a table.

    The summary is also written as ``eval_summary.json`` in the trainer's log directory,
    which is where the README's figures come from.

    Args:
        enabled: Run the two evaluations (they cost rollouts: switch off for smoke runs).
        before: Also evaluate before training. A run that starts from a checkpoint whose
            evaluation is already known (``model.init_from`` a warm start) can skip it.
    """

    def __init__(self, enabled: bool = True, before: bool = True) -> None:
        self.enabled, self.run_before = enabled, before
        self.before: dict[str, float] | None = None
        self.after: dict[str, float] | None = None

    def _evaluate(self, trainer: L.Trainer, module: L.LightningModule, label: str) -> dict[str, float]:
        columns = [TextColumn(f"[bold]{label}[/bold] held-out episodes"), BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn()]
        with Progress(*columns, transient=True, disable=not trainer.is_global_zero) as progress:
            return summarise(list(trainer.datamodule.eval_batches(module, progress)))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.enabled and self.run_before and self.before is None:
            self.before = self._evaluate(trainer, pl_module, "before training:")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        self.after = self._evaluate(trainer, pl_module, "after training:")
        if not trainer.is_global_zero:
            return
        table = Table(title=f"held-out evaluation: {trainer.datamodule.hparams.env}, "
                            f"{int(self.after['episodes'])} episodes, {trainer.global_step} updates")
        table.add_column("")
        for name in ("success rate", "mean return", "mean length", "invalid actions"):
            table.add_column(name, justify="right")
        for label, row in (("before", self.before), ("after", self.after)):
            if row is not None:
                table.add_row(label, f"{row['success']:.3f}", f"{row['return']:.3f}",
                              f"{row['length']:.1f}", f"{row['invalid']:.3f}")
        Console().print(table)
        if run_dir := log_dir(trainer):
            atomic_write_text(Path(run_dir) / "eval_summary.json",
                              json.dumps({"before": self.before, "after": self.after,
                                          "updates": trainer.global_step,
                                          "env_steps": getattr(pl_module, "env_steps", None)}, indent=2))

    def state_dict(self) -> dict[str, Any]:
        return {"before": self.before}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.before = state_dict.get("before")


class EnvStepBudget(L.Callback):
    """Stop ``fit`` once training has taken ``max_env_steps`` environment steps (summed over
    ranks), so that runs whose episodes differ in length compare at equal experience.
    ``trainer.max_steps`` still applies; whichever comes first ends the run.

    Args:
        max_env_steps: The budget; the step that crosses it is the last.
    """

    def __init__(self, max_env_steps: int) -> None:
        if max_env_steps < 1:
            raise ValueError(f"EnvStepBudget max_env_steps must be >= 1, got {max_env_steps}")
        self.max_env_steps = max_env_steps

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        if getattr(pl_module, "env_steps", 0) >= self.max_env_steps:
            trainer.should_stop = True  # every rank counts the same steps: they stop together


class LearningCurve(L.Callback):
    """Append each validation of a fit to ``curve.jsonl`` in the log directory: the
    optimizer step, the training env steps so far, and the ``val/*`` metrics."""

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn != "fit" or trainer.sanity_checking or not trainer.is_global_zero:
            return
        point = {"step": trainer.global_step, "env_steps": getattr(pl_module, "env_steps", None),
                 **{k[4:]: float(v) for k, v in trainer.callback_metrics.items()
                    if k.startswith("val/") and k.count("/") == 1}}
        if run_dir := log_dir(trainer):
            path = Path(run_dir) / "curve.jsonl"
            lines = path.read_text(encoding="utf-8") if path.is_file() else ""
            atomic_write_text(path, lines + json.dumps(point) + "\n")


class LevelTable(L.Callback):
    """After ``hieragent test`` (or validate), one table row per env of ``data.test_envs``.

    Rows come from the logged ``test/<env>/<metric>`` values (``test/<metric>`` for a
    single env) and are also written as ``test_summary.json`` in the log directory.
    """

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer, "test")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._report(trainer, "val")

    def _report(self, trainer: L.Trainer, stage: str) -> None:
        envs = getattr(trainer.datamodule, "test_envs", None) or [trainer.datamodule.hparams.env]
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        rows = {}
        for env in envs:
            prefix = f"{stage}/{env}/" if len(envs) > 1 else f"{stage}/"
            row = {m: metrics.get(prefix + m, float("nan")) for m in ("success", "return", "length", "invalid")}
            rows[env] = row
        if not trainer.is_global_zero:
            return
        table = Table(title=f"{stage}: {trainer.datamodule.hparams.eval_episodes} held-out episodes per env")
        table.add_column("env", no_wrap=True)
        for name in ("success rate", "mean return", "mean length", "invalid actions"):
            table.add_column(name, justify="right")
        for env, row in rows.items():
            table.add_row(env, f"{row['success']:.3f}", f"{row['return']:.3f}", f"{row['length']:.1f}",
                          f"{row['invalid']:.3f}")
        Console(width=max(Console().width, 110)).print(table)
        if run_dir := log_dir(trainer):
            atomic_write_text(Path(run_dir) / f"{stage}_summary.json", json.dumps(rows, indent=2))


class FrozenHeap(L.Callback):
    """Keep Python's full garbage collections off the training steps (``hieragent/heap.py``):
    once training starts, what is alive then (modules, model, bank) is frozen out of the
    collector's walks, and given back when training ends or fails. ``hieragent fit`` adds one
    unless the config lists it; ``enabled: false`` turns it off.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.frozen = 0  # objects frozen by this callback, while they are

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.enabled and not self.frozen:
            self.frozen = heap.freeze()

    def _give_back(self) -> None:
        if self.frozen:
            heap.unfreeze()
            self.frozen = 0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._give_back()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._give_back()


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write a checkpoint to a temporary file beside it, then rename it into place.

    A crash during a save leaves the previous checkpoint intact instead of a truncated file.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        fs = get_filesystem(path)
        if type(fs).__name__ != "LocalFileSystem":
            return super().save_checkpoint(checkpoint, path, storage_options)
        with atomic_open(path, binary=True) as f:
            torch.save(checkpoint, f)


class UpdateProgressBar(RichProgressBar):
    """Rich progress bar labelled by RL update rather than by epoch.

    Rollout data is an endless stream, so ``max_epochs`` is -1 and Lightning's own label
    would read "Epoch 0/-2"; the bar's total is already ``max_steps``.
    """

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs > 0:
            return super()._get_train_description(current_epoch)
        return "updates"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        # one rollout batch may take several optimizer steps (replay.updates_per_batch):
        # count those, the unit of the bar's total (max_steps)
        if trainer.max_epochs is None or trainer.max_epochs <= 0:
            self._update(self.train_progress_bar_id, trainer.global_step)
