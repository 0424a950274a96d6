"""``python -m hieragent.bench.ddp_check``: a short fit in one process, and the same episodes
over N ranks with ``trainer.strategy: ddp``; then FSDP and DeepSpeed, which are refused.

Both fits run ``hieragent fit`` in a subprocess with ``StepProbe``, which records each rank's
step times, peak memory and final trainable parameters. The one-process fit plays
``seeds x N`` seeds per step with per-episode seeding, the DDP fit ``seeds`` per rank, so
both train on the same episodes. The table gives the median step time, the peak memory
(CUDA's allocator on a GPU, the resident set on a CPU), the largest parameter difference
from the one-process fit, and whether the ranks' adapters are bit-identical. Part of
``make device-check`` on a GPU (NCCL, one device); ``--accelerator cpu --devices 2`` runs
it on CPU processes (gloo), which the tests do. Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

REPO = Path(__file__).resolve().parents[2]
# a room where the tiny model's first episodes differ in return, so the first steps move the
# adapters (on configs/tiny.yaml's own room every episode fails alike and nothing moves)
DEFAULT_FLAGS = "--data.env BabyAI-GoToObjS4-v0 --data.group_size 4 --model.score_reduction mean"


class StepProbe(L.Callback):
    """Each rank's step times, peak memory and final trainable parameters, written to
    ``<out>/<label>_rank<r>.pt`` at the end of fit."""

    def __init__(self, out: str, label: str) -> None:
        self.out, self.label = Path(out), label
        self.times: list[float] = []
        self._started = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._started)

    def on_train_end(self, trainer, pl_module) -> None:
        device = next(pl_module.parameters()).device
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) / 2**20
        else:  # ru_maxrss is in KiB on Linux
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save({"times": self.times, "peak_mb": peak, "device": str(device), "world_size": trainer.world_size,
                    "params": {n: p.detach().float().cpu() for n, p in pl_module.trainable_parameters().items()}},
                   self.out / f"{self.label}_rank{trainer.global_rank}.pt")


def fit(label: str, out: Path, args: argparse.Namespace, processes: int, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "hieragent.cli", "fit", "--config", str(REPO / args.config),
               "--trainer.accelerator", args.accelerator, "--trainer.max_steps", str(args.steps),
               "--data.episode_seeding", "true",
               "--trainer.callbacks+=hieragent.bench.ddp_check.StepProbe", f"--trainer.callbacks.out={out}",
               f"--trainer.callbacks.label={label}", *shlex.split(args.flags), *flags]
    if args.model:
        command += ["--model.model", args.model]
    if processes > 1 or label == "ddp":
        command += ["--trainer.strategy", "ddp", "--trainer.devices", str(processes)]
    else:
        command += ["--trainer.devices", "1"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    run_dir = out / label  # logs and checkpoints stay in the scratch folder
    run_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(command, cwd=run_dir, env=env, capture_output=True, text=True, timeout=args.timeout)


def refusal(strategy: str, args: argparse.Namespace) -> str:
    """The one line ``hieragent fit`` answers a strategy it does not run with."""
    done = subprocess.run([sys.executable, "-m", "hieragent.cli", "fit", "--config", str(REPO / args.config),
                           "--trainer.accelerator", args.accelerator, "--trainer.strategy", strategy],
                          capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in done.stderr.splitlines() if line.startswith("hieragent: error")]
    return lines[0] if lines else f"exit {done.returncode} (no refusal line)"


def summary(out: Path, label: str, processes: int, reference: dict | None) -> dict:
    ranks = [torch.load(out / f"{label}_rank{r}.pt", weights_only=False) for r in range(processes)]
    first = ranks[0]
    row = {"run": label, "processes": processes, "device": first["device"],
           "step_s_median": statistics.median(first["times"][1:] or first["times"]),
           "peak_mb": max(r["peak_mb"] for r in ranks),
           "ranks_identical": all(torch.equal(p, r["params"][n]) for r in ranks[1:] for n, p in first["params"].items()),
           # LoRA B starts at zero: how far training moved it
           "max_lora_b": max(float(p.abs().max()) for n, p in first["params"].items() if "lora_B" in n)}
    if reference is not None:
        row["max_param_diff"] = max(float((p - reference[n]).abs().max()) for n, p in first["params"].items())
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--devices", type=int, default=1, help="DDP ranks (GPUs, or CPU processes)")
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--model", default=None, help="model.model, e.g. smollm2 (default: the config's)")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per rank and step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--flags", default=DEFAULT_FLAGS, help="further `hieragent fit` flags for both fits")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=None, help="JSON file for the table")
    args = parser.parse_args(argv)
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        sys.exit("ddp_check --accelerator gpu needs a CUDA GPU; this machine has none (--accelerator cpu runs it "
                 "on CPU processes)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="hieragent-ddp-check-") as tmp:
        out = Path(tmp)
        for label, processes, seeds in (("one_process", 1, args.seeds * args.devices), ("ddp", args.devices, args.seeds)):
            done = fit(label, out, args, processes, "--data.seeds_per_batch", str(seeds))
            if done.returncode != 0:
                sys.exit(f"ddp_check: the {label} fit failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        one = summary(out, "one_process", 1, None)
        reference = torch.load(out / "one_process_rank0.pt", weights_only=False)["params"]
        rows = [one, summary(out, "ddp", args.devices, reference)]
    for strategy in ("fsdp", "deepspeed_stage_2"):
        rows.append({"run": strategy, "refused": refusal(strategy, args)})
    print(f"{'run':<18}{'procs':>6}{'step s':>9}{'peak MB':>10}{'max |B|':>10}{'max |dθ|':>11}  ranks identical")
    for row in rows:
        if "refused" in row:
            print(f"{row['run']:<18}  {row['refused']}")
            continue
        diff = f"{row['max_param_diff']:.1e}" if "max_param_diff" in row else "-"
        print(f"{row['run']:<18}{row['processes']:>6}{row['step_s_median']:>9.3f}{row['peak_mb']:>10.0f}"
              f"{row['max_lora_b']:>10.1e}{diff:>11}  {row['ranks_identical']}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
