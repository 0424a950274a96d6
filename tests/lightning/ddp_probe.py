"""A test-only callback that records what each rank of a (multi-process) fit held.

Given to ``hieragent fit`` as ``--trainer.callbacks+=ddp_probe.RankProbe`` (the test puts
this folder on ``PYTHONPATH``, which the ranks Lightning launches inherit). Each rank writes
``<out>/rank<r>.pt`` at the end of fit: its adapters, its bank, the seeds and turn counts of
its batches, the skip of each update, the first update's gradients (summed over the ranks,
before clipping), and its share of a final held-out evaluation with the
summary over every rank. ``poison_rank`` writes a NaN into one behaviour log-prob of that
rank's batch at ``poison_step``, once; ``rogue_rank`` adds a bank entry on that rank alone.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import lightning as L
import torch

from hieragent.lightning.callbacks import summarise


class RankProbe(L.Callback):
    def __init__(self, out: str, poison_rank: int | None = None, poison_step: int = 1,
                 rogue_rank: int | None = None) -> None:
        self.out, self.poison_rank, self.poison_step = Path(out), poison_rank, poison_step
        self.rogue_rank = rogue_rank
        self.batches: list[dict] = []
        self.skips: list[str | None] = []
        self.poisoned = False
        self.grads: dict[str, torch.Tensor] = {}

    def setup(self, trainer, pl_module, stage) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        rank = trainer.global_rank
        (self.out / f"rank{rank}.pid").write_text(str(os.getpid()))
        collect_train, update, agree = pl_module.collect_train, pl_module._update, pl_module._agree
        names = {id(p): n for n, p in pl_module.named_parameters()}

        def recording_collect(pool, seeds, groups, generator=None):
            batch = collect_train(pool, seeds, groups, generator=generator)
            if rank == self.poison_rank and pl_module.global_step == self.poison_step and not self.poisoned:
                batch.turns("executor")[0].old_logprobs[0] = float("nan")
                self.poisoned = True
            if rank == self.rogue_rank and pl_module.global_step == 1:  # a bank entry on one rank only
                pl_module.bank.add(["a skill only this rank has"], kind="skill", source=["rogue"], step=1)
            micro = pl_module.objective.micro_batch_turns
            self.batches.append({"step": pl_module.global_step, "seeds": list(seeds),
                                 "turns": len(batch.turns()),
                                 "micro_batches": sum(math.ceil(len(batch.turns(r)) / micro)
                                                      for r in ("planner", "executor"))})
            return batch

        def recording_update(batches):
            skip = update(batches)
            self.skips.append(skip)
            return skip

        def recording_agree(opt, skip, sums, stats):
            out = agree(opt, skip, sums, stats)
            if not self.grads:  # the first update's gradients, summed over ranks, before clipping
                self.grads = {names[id(p)]: p.grad.clone() for g in opt.param_groups for p in g["params"]
                              if p.grad is not None}
            return out

        pl_module.collect_train, pl_module._update = recording_collect, recording_update
        pl_module._agree = recording_agree

    def on_train_end(self, trainer, pl_module) -> None:
        local = list(trainer.datamodule.eval_batches(pl_module))
        summary = summarise(local)  # over every rank
        torch.save({
            "params": {n: p.detach().clone() for n, p in pl_module.trainable_parameters().items()},
            "bank": pl_module.bank.state_dict(),
            "batches": self.batches,
            "skips": self.skips,
            "grads": self.grads,
            "eval_local": [float(t.success) for b in local for t in b.trajectories],
            "eval_seeds": [t.seed for b in local for t in b.trajectories],
            "eval_summary": summary,
            "world_size": trainer.world_size,
        }, self.out / f"rank{trainer.global_rank}.pt")


def collectives_worker(rank: int, port: int, out: str) -> None:
    """Rank ``rank`` of a 2-process gloo group: the collectives of ``lightning/distributed.py``
    on random inputs, then rank 0 alone in a collective that rank 1 never joins."""
    from datetime import timedelta

    import torch.distributed as dist

    from hieragent.lightning.distributed import all_sum, gather_objects, sum_gradients

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=3))
    g = torch.Generator().manual_seed(100 + rank)
    values = torch.randn(5, generator=g, dtype=torch.float64)
    params = [torch.nn.Parameter(torch.randn(3, 4, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]
    params[0].grad = torch.randn(3, 4, generator=g)
    if rank == 0:
        params[1].grad = torch.randn(7, generator=g)  # rank 1 has none: it takes part with zeros
    local_grads = [None if p.grad is None else p.grad.clone() for p in params]
    summed = all_sum(values, "test sums")
    gathered = gather_objects({"rank": rank}, "test gather")
    sum_gradients(params, "test gradients")
    record = {"values": values, "summed": summed, "gathered": gathered, "local_grads": local_grads,
              "grads": [p.grad.clone() for p in params], "error": None}
    dist.barrier()
    if rank == 0:
        try:
            all_sum([1.0], "the lonely stage")
        except RuntimeError as err:
            record["error"] = str(err)
    else:
        import time

        time.sleep(8)
    torch.save(record, Path(out) / f"collectives{rank}.pt")
    # a group whose collective timed out can abort in its destructor at exit; the results are saved
    os._exit(0)
