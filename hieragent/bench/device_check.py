"""``make device-check``: the vLLM engine against the HF engine on one GPU, in a few minutes.

SmolLM2-135M-Instruct with the planner and executor adapters (LoRA B drawn at random, so
the adapters change the output) is served by both engines on the same weights. For each
adapter and each of two synced versions (the weights perturbed again between them, so the
second shows vLLM reloading the adapters), the same prompts and candidate continuations
are scored by both; the table gives the max and mean per-token |log-prob gap|, and how far
vLLM's scores moved from version 1 to 2 (a reload that did not happen moves nothing).
Then each engine samples completions (temperature 1): turns per second, and the gap
between vLLM's sampled log-probs and the HF engine's score of the same tokens, which is
the gap the trainer's truncated IS sees. Last, a sleep/wake round trip must leave vLLM's
scores unchanged. Writes JSON to ``--out``; without a CUDA GPU or vllm it prints one line
and exits with 2, writing nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch

MISSIONS = ["go to the red ball", "pick up the blue key", "open the yellow door", "go to the green box",
            "put the grey ball next to the purple key", "pick up a box", "go to a door", "open the red door"]
ACTIONS = ["turn left", "turn right", "go forward", "pick up", "drop", "toggle", "done"]


def perturb(lm: torch.nn.Module, generator: torch.Generator, scale: float = 0.05) -> None:
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator).to(p) * scale)


def gaps(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> torch.Tensor:
    return torch.cat([(x - y).abs() for ra, rb in zip(a, b) for x, y in zip(ra, rb)])  # [tokens]


def stats(gap: torch.Tensor) -> dict[str, float]:
    return {"max": float(gap.max()), "mean": float(gap.mean()), "tokens": int(gap.numel())}


def timed(fn, *args) -> tuple[object, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="device_check.json", help="where the JSON report goes")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"), help="vLLM's dtype")
    parser.add_argument("--turns", type=int, default=256, help="completions per adapter for turns/s")
    parser.add_argument("--new-tokens", type=int, default=12, help="max new tokens per completion")
    parser.add_argument("--memory", type=float, default=0.3, help="vLLM's gpu_memory_utilization")
    parser.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs (faster start)")
    args = parser.parse_args(argv)

    # the two checks before anything heavy is imported or written
    if not torch.cuda.is_available():
        print("device_check needs a CUDA GPU (and the vllm extra); this machine has none", file=sys.stderr)
        return 2
    from hieragent.engines.vllm import EngineUnavailable, require_vllm

    try:
        require_vllm()
    except EngineUnavailable as err:
        print(f"device_check: {err}", file=sys.stderr)
        return 2

    from rich.console import Console
    from rich.table import Table

    from hieragent.engines.base import EngineSettings, Request, Sampling
    from hieragent.engines.hf import HFEngine
    from hieragent.engines.prompting import Prompter
    from hieragent.engines.vllm import VLLMEngine
    from hieragent.io import atomic_write_text
    from hieragent.models.loading import load_causal_lm, load_tokenizer, smollm2_dir
    from hieragent.models.lora import LoraSettings, add_adapters

    console = Console()
    started = time.perf_counter()
    tokenizer = load_tokenizer("smollm2")
    lm = add_adapters(load_causal_lm("smollm2"), ["planner", "executor"], LoraSettings()).cuda().eval()
    params = {n: p for n, p in lm.named_parameters() if p.requires_grad}
    g = torch.Generator().manual_seed(0)
    perturb(lm, g)
    eos = tokenizer.eos_token_id
    settings = EngineSettings(gpu_memory_utilization=args.memory)
    hf = HFEngine(lm, pad_id=tokenizer.pad_token_id, eos_id=eos, settings=settings)
    workdir = tempfile.mkdtemp(prefix="hieragent-vllm-")
    t0 = time.perf_counter()
    vl = VLLMEngine(lm, smollm2_dir(), eos_id=eos, workdir=workdir, settings=settings, dtype=args.dtype,
                    enforce_eager=args.eager)
    report: dict = {"gpu": torch.cuda.get_device_name(), "vllm_dtype": args.dtype, "hf_dtype": "float32",
                    "vllm_start_s": time.perf_counter() - t0, "score": {}, "generate": {}}

    prompter = Prompter(tokenizer)
    prompts = [prompter.executor_prompt(m, "You see a wall 2 steps forward.", None)[0] for m in MISSIONS]
    cands = [[tokenizer.encode(a, add_special_tokens=False) + [eos] for a in ACTIONS]] * len(prompts)
    previous: dict[str, list[list[torch.Tensor]]] = {}
    for version in (1, 2):
        if version == 2:
            perturb(lm, g)
        hf.sync(params, version)
        vl.sync(params, version)
        for adapter in ("planner", "executor"):
            requests = [Request(p, adapter) for p in prompts]
            ref, got = hf.score(requests, cands), vl.score(requests, cands)
            row = stats(gaps(ref, got))
            if adapter in previous:
                row["moved_since_v1"] = float(gaps(previous[adapter], got).max())
            previous[adapter] = got
            report["score"][f"{adapter} v{version}"] = row

    sampling = Sampling(temperature=1.0, max_new_tokens=args.new_tokens)
    for adapter in ("planner", "executor"):
        requests = [Request(prompts[i % len(prompts)], adapter, sampling=sampling) for i in range(args.turns)]
        vl.generate(requests[:8], torch.Generator().manual_seed(1))  # warm-up
        hf.generate(requests[:8], torch.Generator().manual_seed(1))
        got, vl_s = timed(vl.generate, requests, torch.Generator().manual_seed(2))
        _, hf_s = timed(hf.generate, requests, torch.Generator().manual_seed(2))
        kept = [(r, x) for r, x in zip(requests, got) if x.ids]
        rescored = hf.score([r for r, _ in kept], [[x.ids] for _, x in kept])
        sampled = [[torch.tensor(x.logprobs)] for _, x in kept]
        again = vl.generate(requests, torch.Generator().manual_seed(2))  # same seeds, same batch
        report["generate"][adapter] = {
            "turns": args.turns, "vllm_turns_per_s": args.turns / vl_s, "hf_turns_per_s": args.turns / hf_s,
            "mean_new_tokens": sum(len(x.ids) for x in got) / len(got),
            "stopped": sum(x.finish_reason == "stop" for x in got) / len(got),
            "sampled_logprob_gap": stats(gaps(rescored, sampled)),
            "seeded_repeat_equal": sum(a.ids == b.ids for a, b in zip(again, got)) / len(got),
        }

    requests = [Request(p, "executor") for p in prompts]
    before = vl.score(requests, cands)
    vl.sleep()
    vl.wake()
    report["sleep_wake_max_change"] = float(gaps(before, vl.score(requests, cands)).max())
    report["total_s"] = time.perf_counter() - started

    table = Table(title=f"vLLM ({args.dtype}) vs HF (float32) on {report['gpu']}")
    for col in ("check", "max |gap|", "mean |gap|", "tokens", "other"):
        table.add_column(col)
    for key, row in report["score"].items():
        other = f"moved since v1: {row['moved_since_v1']:.3f}" if "moved_since_v1" in row else ""
        table.add_row(f"score {key}", f"{row['max']:.4f}", f"{row['mean']:.4f}", str(row["tokens"]), other)
    for adapter, row in report["generate"].items():
        gap = row["sampled_logprob_gap"]
        table.add_row(f"generate {adapter}", f"{gap['max']:.4f}", f"{gap['mean']:.4f}", str(gap["tokens"]),
                      f"turns/s vllm {row['vllm_turns_per_s']:.0f}, hf {row['hf_turns_per_s']:.0f}; "
                      f"seeded repeats equal: {row['seeded_repeat_equal']:.0%}")
    table.add_row("sleep + wake", f"{report['sleep_wake_max_change']:.4f}", "", "",
                  "score change after the round trip")
    console.print(table)
    console.print(f"vLLM start {report['vllm_start_s']:.0f} s, total {report['total_s']:.0f} s; "
                  f"JSON: {args.out}")
    atomic_write_text(args.out, json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
