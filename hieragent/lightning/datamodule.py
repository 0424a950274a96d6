"""Training data made by rollouts with the current policy, and held-out evaluation seeds.

Each training item is a ``Batch``: ``seeds_per_batch`` environment seeds, each played
``group_size`` times (a GRPO group). Rollouts run when the training step asks for the
item, so they use the weights of that step. Evaluation plays seeds from a range disjoint
from training, with a fixed sampling seed, so that "before" and "after" compare the same
episodes.
"""

from __future__ import annotations

from typing import Any, Iterator

import lightning as L
import torch
from rich.progress import Progress
from torch.utils.data import DataLoader, IterableDataset

from hieragent.envs.base import check_env_name
from hieragent.envs.pool import EnvPool
from hieragent.types import Batch

EVAL_SEED_OFFSET = 1_000_000


class _Rollouts(IterableDataset):
    """Yields batches produced on demand by ``make()``."""

    def __init__(self, make, length: int | None) -> None:
        self.make, self.length = make, length

    def __iter__(self) -> Iterator[Batch]:
        index = 0
        while self.length is None or index < self.length:
            yield self.make(index)
            index += 1

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("an endless rollout stream has no length")
        return self.length


class RolloutDataModule(L.LightningDataModule):
    """Environment pools and the seeds they play.

    Args:
        env: Environment name, e.g. ``BabyAI-GoToLocal-v0`` (see ``hieragent envs``).
        max_episode_steps: Step cap per episode; ``None`` keeps the level's own.
        invalid_penalty: Reward subtracted for an action that cannot be parsed or grounded.
        seeds_per_batch: Distinct environment seeds per training batch.
        group_size: Rollouts per seed (the GRPO group).
        batches_per_epoch: Training batches per epoch (an epoch is only a logging unit).
        train_seed: First training seed; seeds then advance and never repeat in a run.
        eval_episodes: Held-out episodes per evaluation.
        eval_batch: Episodes played side by side during evaluation.
        eval_greedy: Evaluate with argmax choices instead of sampling.
        eval_sample_seed: Sampling seed of evaluation, so that evaluations are comparable.
    """

    def __init__(
        self,
        env: str = "BabyAI-GoToLocal-v0",
        max_episode_steps: int | None = None,
        invalid_penalty: float = 0.1,
        seeds_per_batch: int = 4,
        group_size: int = 4,
        batches_per_epoch: int = 1000,
        train_seed: int = 0,
        eval_episodes: int = 16,
        eval_batch: int = 16,
        eval_greedy: bool = False,
        eval_sample_seed: int = 1234,
    ) -> None:
        super().__init__()
        check_env_name(env)
        for key, value in (("seeds_per_batch", seeds_per_batch), ("group_size", group_size),
                           ("eval_episodes", eval_episodes), ("eval_batch", eval_batch),
                           ("batches_per_epoch", batches_per_epoch)):
            if value < 1:
                raise ValueError(f"data.{key} must be >= 1, got {value}")
        if not 0 <= train_seed < EVAL_SEED_OFFSET:
            raise ValueError(f"data.train_seed must be in [0, {EVAL_SEED_OFFSET}), got {train_seed}: "
                             "seeds from there on are held out for evaluation")
        self.save_hyperparameters()
        self.env_kwargs: dict[str, Any] = {"max_steps": max_episode_steps,
                                           "invalid_penalty": invalid_penalty}
        self.next_seed = train_seed
        self._train_pool: EnvPool | None = None
        self._eval_pool: EnvPool | None = None

    # -- pools -------------------------------------------------------------------------
    def train_pool(self) -> EnvPool:
        if self._train_pool is None:
            n = self.hparams.seeds_per_batch * self.hparams.group_size
            self._train_pool = EnvPool.make(self.hparams.env, n, **self.env_kwargs)
        return self._train_pool

    def eval_pool(self, n: int) -> EnvPool:
        if self._eval_pool is None or len(self._eval_pool) != n:
            self._eval_pool = EnvPool.make(self.hparams.env, n, **self.env_kwargs)
        return self._eval_pool

    # -- batches -----------------------------------------------------------------------
    def train_batch(self, module) -> Batch:
        """The next training batch, rolled out by ``module`` with its current weights."""
        g, s = self.hparams.group_size, self.hparams.seeds_per_batch
        # training seeds wrap below the held-out range, so they never meet it
        seeds = [(self.next_seed + j) % EVAL_SEED_OFFSET for j in range(s) for _ in range(g)]
        self.next_seed += s
        return module.collect_train(self.train_pool(), seeds, groups=seeds)

    def eval_batches(self, module, progress: Progress | None = None) -> Iterator[Batch]:
        """Held-out episodes, in chunks of ``eval_batch``, with a fixed sampling seed."""
        total, width = self.hparams.eval_episodes, self.hparams.eval_batch
        generator = torch.Generator().manual_seed(self.hparams.eval_sample_seed)
        task = progress.add_task("evaluating", total=total) if progress is not None else None
        done = 0
        for start in range(0, total, width):
            seeds = [EVAL_SEED_OFFSET + i for i in range(start, min(start + width, total))]
            pool = self.eval_pool(len(seeds))
            on_step = (lambda k, d=done: progress.update(task, completed=d + k)) if task is not None else None
            yield module.collect(pool, seeds, list(range(len(seeds))),
                                 greedy=self.hparams.eval_greedy, generator=generator,
                                 on_step=on_step)
            done += len(seeds)

    # -- Lightning hooks ---------------------------------------------------------------
    def _module(self):
        if self.trainer is None or self.trainer.lightning_module is None:
            raise RuntimeError("RolloutDataModule needs a Trainer with a HierAgentModule attached")
        return self.trainer.lightning_module

    def train_dataloader(self) -> DataLoader:
        data = _Rollouts(lambda _: self.train_batch(self._module()), self.hparams.batches_per_epoch)
        return DataLoader(data, batch_size=None, collate_fn=_identity, num_workers=0)

    def _eval_loader(self) -> DataLoader:
        chunks = -(-self.hparams.eval_episodes // self.hparams.eval_batch)
        stream: dict[str, Iterator[Batch]] = {}

        def make(index: int) -> Batch:
            if index == 0:
                stream["it"] = self.eval_batches(self._module())
            return next(stream["it"])

        return DataLoader(_Rollouts(make, chunks), batch_size=None, collate_fn=_identity,
                          num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader()

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader()

    def state_dict(self) -> dict[str, Any]:
        return {"next_seed": self.next_seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.next_seed = int(state_dict["next_seed"])


def _identity(x: Any) -> Any:
    return x
