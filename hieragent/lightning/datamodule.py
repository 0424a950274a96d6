"""Training data made by rollouts with the current policy, and held-out evaluation seeds.

Each training item is a ``Batch``: ``seeds_per_batch`` environment seeds, each played
``group_size`` times (a GRPO group). Rollouts run when the training step asks for the
item, so they use the weights of that step. Evaluation plays seeds from a range disjoint
from training, with a fixed sampling seed, so that "before" and "after" compare the same
episodes.

Across processes (``trainer.strategy: ddp``) each rank plays ``seeds_per_batch`` seeds of
its own, as whole groups: rank ``r`` of ``R`` takes the ``r``-th block of the next
``R x seeds_per_batch`` seeds, so the ranks together play what one process with
``seeds_per_batch x R`` would. Held-out episodes are dealt round-robin over the ranks. With
``episode_seeding`` every episode samples from a generator of its own, seeded from the run's
seed and the episode's index, so it plays the same on whichever rank plays it.
"""

from __future__ import annotations

from typing import Any, Iterator

import lightning as L
import torch
from rich.progress import Progress
from torch.utils.data import DataLoader, IterableDataset

from hieragent.envs.base import EVAL_SEED_OFFSET, check_env_name
from hieragent.envs.pool import EnvPool
from hieragent.lightning.distributed import distributed, world
from hieragent.sampling import episode_generators
from hieragent.types import Batch


def check_processes(eval_episodes: int, demos: str | None, processes: int) -> None:
    """What several processes need of the data: every rank evaluates at least one episode (a
    rank without any would skip the collectives the others wait in), and no warm start,
    whose supervised step syncs nothing across ranks."""
    if eval_episodes < processes:
        raise ValueError(f"data.eval_episodes ({eval_episodes}) must be at least the number of processes "
                         f"({processes}): every rank evaluates its share")
    if demos and processes > 1:
        raise ValueError(f"data.demos: the supervised warm start runs in one process, not {processes}; run it "
                         "alone and start the multi-process RL run from it with model.init_from")


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
        seeds_per_batch: Distinct environment seeds per training batch, per process.
        group_size: Rollouts per seed (the GRPO group).
        batches_per_epoch: Training batches per epoch (an epoch is only a logging unit).
        train_seed: First training seed; seeds then advance and never repeat in a run.
        eval_episodes: Held-out episodes per evaluation, over all processes.
        eval_batch: Episodes played side by side during evaluation.
        eval_greedy: Evaluate with argmax choices instead of sampling.
        eval_sample_seed: Sampling seed of evaluation, so that evaluations are comparable.
        env_options: Further keyword arguments of the env family, e.g. ``games_dir`` for
            TextWorld or ``is_slippery`` for FrozenLake.
        train_seeds: Size of a fixed training set: seeds ``train_seed + i`` wrap modulo
            this (e.g. a pre-generated set of TextWorld games); ``None`` never repeats.
        test_envs: Envs that ``hieragent test`` and validation evaluate, each on its own
            held-out seeds and logged under its name; ``None`` is ``[env]``.
        demos: A demonstrations JSONL (``hieragent.rollout.demos``): training batches are
            then expert episodes for the supervised warm start, not rollouts.
        demo_batch: Demonstrations per warm-start step.
        workers: Env worker processes per pool; ``0`` steps the envs in this process.
        step_timeout: Seconds a worker may take for one batched call before it is
            restarted and its episodes dropped (workers only).
        loop_guard: End an episode, with ``loop_penalty``, when its last this-many steps
            repeat with a short period (see ``hieragent.envs.guards``); ``None`` is off.
        loop_penalty: Reward subtracted on the step the loop guard ends an episode.
        episode_seeding: Sample each episode from its own generator, seeded from the run's
            seed (``seed_everything``) and the episode's index and replica, so an episode is
            the same whichever rank plays it and whatever else is in its batch. ``None``: on
            across processes, off in one process, where one stream serves the whole batch
            (the stream the README's single-process figures were measured with).
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
        env_options: dict[str, Any] | None = None,
        train_seeds: int | None = None,
        test_envs: list[str] | None = None,
        demos: str | None = None,
        demo_batch: int = 8,
        workers: int = 0,
        step_timeout: float | None = 60.0,
        loop_guard: int | None = None,
        loop_penalty: float = 1.0,
        episode_seeding: bool | None = None,
    ) -> None:
        super().__init__()
        for name in [env, *(test_envs or [])]:
            check_env_name(name)
        if test_envs is not None and not test_envs:
            raise ValueError("data.test_envs must name at least one env, or be null for [data.env]")
        if train_seeds is not None and not 1 <= train_seed + train_seeds <= EVAL_SEED_OFFSET:
            raise ValueError(f"data.train_seeds must be >= 1 with data.train_seed + data.train_seeds "
                             f"<= {EVAL_SEED_OFFSET} (the held-out range), got {train_seeds}")
        if workers < 0:
            raise ValueError(f"data.workers must be >= 0, got {workers}")
        if loop_guard is not None and loop_guard < 2:
            raise ValueError(f"data.loop_guard must be >= 2 or null, got {loop_guard}")
        if demo_batch < 1:
            raise ValueError(f"data.demo_batch must be >= 1, got {demo_batch}")
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
                                           "invalid_penalty": invalid_penalty, **(env_options or {})}
        self.next_seed = train_seed
        self.pool_kwargs: dict[str, Any] = {"workers": workers, "step_timeout": step_timeout,
                                            "loop_guard": loop_guard, "loop_penalty": loop_penalty}
        self.test_envs = list(test_envs) if test_envs else [env]
        self._train_pool: EnvPool | None = None
        self._eval_pools: dict[str, EnvPool] = {}
        self._demos: list | None = None
        self._demo_order = torch.Generator().manual_seed(train_seed)
        self._sample_seed = torch.initial_seed()

    def setup(self, stage: str) -> None:
        # after seed_everything (and, across processes, Lightning's re-seeding of each rank)
        self._sample_seed = torch.initial_seed()
        check_processes(self.hparams.eval_episodes, self.hparams.demos, world()[1])

    def per_episode(self) -> bool:
        """Whether episodes sample from generators of their own (``episode_seeding``)."""
        chosen = self.hparams.episode_seeding
        return distributed() if chosen is None else bool(chosen)

    # -- pools -------------------------------------------------------------------------
    def train_pool(self) -> EnvPool:
        if self._train_pool is None:
            n = self.hparams.seeds_per_batch * self.hparams.group_size
            self._train_pool = EnvPool.make(self.hparams.env, n, **self.pool_kwargs, **self.env_kwargs)
        return self._train_pool

    def eval_pool(self, n: int, env: str | None = None) -> EnvPool:
        env = env or self.hparams.env
        if env not in self._eval_pools or len(self._eval_pools[env]) != n:
            if env in self._eval_pools:
                self._eval_pools[env].close()
            self._eval_pools[env] = EnvPool.make(env, n, **self.pool_kwargs, **self.env_kwargs)
        return self._eval_pools[env]

    def env_counters(self) -> dict[str, float]:
        """Episodes dropped by env failures and worker restarts, over this run's pools."""
        pools = [p for p in [self._train_pool, *self._eval_pools.values()] if p is not None]
        return {"env/dropped_episodes": float(sum(p.dropped_episodes for p in pools)),
                "env/worker_restarts": float(sum(p.restarts for p in pools))}

    def teardown(self, stage: str) -> None:
        for pool in [self._train_pool, *self._eval_pools.values()]:
            if pool is not None:
                pool.close()
        self._train_pool, self._eval_pools = None, {}

    # -- batches -----------------------------------------------------------------------
    def train_batch(self, module) -> Batch:
        """The next training batch, rolled out by ``module`` with its current weights."""
        g, s = self.hparams.group_size, self.hparams.seeds_per_batch
        rank, processes = world()
        # (episode index, replica): this rank's block of the next processes x s seeds
        keys = [(self.next_seed + rank * s + j, i) for j in range(s) for i in range(g)]
        self.next_seed += s * processes
        # training seeds wrap below the held-out range, so they never meet it
        seeds = [self._train_seed(k) for k, _ in keys]
        generator = episode_generators(self._sample_seed, keys) if self.per_episode() else None
        return module.collect_train(self.train_pool(), seeds, groups=seeds, generator=generator)

    def _train_seed(self, k: int) -> int:
        first, wrap = self.hparams.train_seed, self.hparams.train_seeds
        if wrap is not None:
            return first + (k - first) % wrap
        return k % EVAL_SEED_OFFSET

    def demo_batch(self) -> list:
        """The next warm-start batch: ``demo_batch`` demonstrations, reshuffled each pass."""
        from hieragent.rollout.demos import read_demonstrations

        if self._demos is None:
            self._demos = read_demonstrations(self.hparams.demos)
            self._demo_queue: list[int] = []
        out = []
        while len(out) < self.hparams.demo_batch:
            if not self._demo_queue:
                self._demo_queue = torch.randperm(len(self._demos), generator=self._demo_order).tolist()
            out.append(self._demos[self._demo_queue.pop()])
        return out

    def eval_batches(self, module, progress: Progress | None = None,
                     env: str | None = None) -> Iterator[Batch]:
        """This rank's held-out episodes of ``env`` (default ``data.env``), in chunks of
        ``eval_batch``, with a fixed sampling seed."""
        width = self.hparams.eval_batch
        mine = self._eval_indices()
        generator = torch.Generator().manual_seed(self.hparams.eval_sample_seed)
        task = progress.add_task("evaluating", total=len(mine)) if progress is not None else None
        done = 0
        for start in range(0, len(mine), width):
            chunk = mine[start:start + width]
            seeds = [EVAL_SEED_OFFSET + i for i in chunk]
            if self.per_episode():
                generator = episode_generators(self.hparams.eval_sample_seed, [(i,) for i in chunk])
            pool = self.eval_pool(len(seeds), env)
            on_step = (lambda k, d=done: progress.update(task, completed=d + k)) if task is not None else None
            yield module.collect(pool, seeds, list(range(len(seeds))),
                                 greedy=self.hparams.eval_greedy, generator=generator,
                                 on_step=on_step)
            done += len(seeds)

    def _eval_indices(self) -> list[int]:
        """This rank's share of the held-out episodes, dealt round-robin."""
        rank, processes = world()
        return list(range(rank, self.hparams.eval_episodes, processes))

    # -- Lightning hooks ---------------------------------------------------------------
    def _module(self):
        if self.trainer is None or self.trainer.lightning_module is None:
            raise RuntimeError("RolloutDataModule needs a Trainer with a HierAgentModule attached")
        return self.trainer.lightning_module

    def train_dataloader(self) -> DataLoader:
        if self.hparams.demos:
            data = _Rollouts(lambda _: self.demo_batch(), self.hparams.batches_per_epoch)
        else:
            data = _Rollouts(lambda _: self.train_batch(self._module()), self.hparams.batches_per_epoch)
        return DataLoader(data, batch_size=None, collate_fn=_identity, num_workers=0)

    def _eval_loader(self, env: str) -> DataLoader:
        chunks = -(-len(self._eval_indices()) // self.hparams.eval_batch)
        stream: dict[str, Iterator[Batch]] = {}

        def make(index: int) -> Batch:
            if index == 0:
                stream["it"] = self.eval_batches(self._module(), env=env)
            return next(stream["it"])

        return DataLoader(_Rollouts(make, chunks), batch_size=None, collate_fn=_identity,
                          num_workers=0)

    def _eval_loaders(self) -> DataLoader | list[DataLoader]:
        loaders = [self._eval_loader(env) for env in self.test_envs]
        return loaders[0] if len(loaders) == 1 else loaders

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        return self._eval_loaders()

    def test_dataloader(self) -> DataLoader | list[DataLoader]:
        return self._eval_loaders()

    def state_dict(self) -> dict[str, Any]:
        return {"next_seed": self.next_seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.next_seed = int(state_dict["next_seed"])


def _identity(x: Any) -> Any:
    return x
