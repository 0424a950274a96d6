"""``make bench-attention``: what the trainer's attention and output head cost, transformers'
way against ours.

The trainer scores recorded turns with a forward and a backward pass (``score`` mode: each
turn's prompt, then its candidates on the prompt's cache). transformers' ``sdpa`` copies
every key/value head once per query head whenever a mask is given (``repeat_kv``), in every
layer, and the backward pass keeps those copies. hieragent loads its models with
``engines.kv.grouped_attention``, which attends on the key/value heads as they are. And
the model's own forward turns every scored position into a row of vocabulary logits (and
the backward into more such rows), where hieragent's ``agents.head`` takes the hidden
states through the output head a block of rows at a time.

On synthetic turns at the shape of a BabyAI planner turn (``--turns`` turns of up to
``--prompt`` tokens, each with ``--candidates`` candidates of 1 to ``--candidate-tokens``
tokens; prompts of different lengths, so padded),
each variant (SDPA with full logits, grouped attention with full logits, grouped attention
with the blocked head: the trainer's) runs the same forward and backward with SmolLM2-135M
and its LoRA adapter, in the precision ``hieragent fit`` would choose here:

* time: the median of ``--reps`` calls, the variants alternating in one process, and the
  ratio against the first's measured in the same run;
* memory: the peak resident memory of one call above the memory before it, each variant in
  a fresh process of its own (so that none reuses memory another freed);
* agreement: the largest difference between a variant's log-probabilities and the first's.

``--quick`` runs the tiny random model at small sizes (the test).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from hieragent.agents.head import full_logits
from hieragent.agents.scoring import candidate_logprobs
from hieragent.engines.kv import GROUPED
from hieragent.models.loading import load_causal_lm, load_tokenizer
from hieragent.models.lora import LoraSettings, add_adapters
from hieragent.precision import autocast_dtype, cast_for, resolve_precision

# name -> (attention, blocked head, row label); the first is the baseline
VARIANTS = {"sdpa": ("sdpa", False, "sdpa (repeat_kv), full logits"),
            "grouped": (GROUPED, False, "grouped, full logits"),
            "trainer": (GROUPED, True, "grouped, blocked head (trainer)")}


def setting(a: argparse.Namespace):
    """The model with its adapter, the turns, and the autocast dtype of the chosen precision."""
    model = "tiny" if a.quick else "smollm2"
    tokenizer = load_tokenizer(model)
    lm = add_adapters(load_causal_lm(model, seed=0), ["executor"], LoraSettings(r=8, alpha=16))
    lm = cast_for(lm, a.precision)
    lm.train()
    g = torch.Generator().manual_seed(a.seed)
    vocab = len(tokenizer)
    lengths = torch.randint(a.prompt * 3 // 4, a.prompt + 1, (a.turns,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    cands = [[torch.randint(0, vocab, (int(k),), generator=g).tolist()
              for k in torch.randint(1, a.candidate_tokens + 1, (a.candidates,), generator=g)]
             for _ in prompts]
    return lm, tokenizer.pad_token_id, prompts, cands, autocast_dtype(a.precision)


def call(lm, pad_id, prompts, cands, autocast, variant: str) -> list[torch.Tensor]:
    """One forward and backward of ``variant``; returns the log-probabilities."""
    attention, blocked, _ = VARIANTS[variant]
    lm.get_base_model().config._attn_implementation = attention
    lm.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast) if autocast is not None else nullcontext():
        with nullcontext() if blocked else full_logits():
            lps = candidate_logprobs(lm, prompts, cands, pad_id)
    sum(lp.sum() for lp in lps).backward()
    return [lp.detach().float() for lp in lps]


def rss_mb() -> tuple[int, int]:
    """(resident, peak resident since the last reset) in MB, from /proc."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["VmRSS"].split()[0]) // 1024, int(fields["VmHWM"].split()[0]) // 1024


def child(a: argparse.Namespace) -> None:
    """One call of ``a.child``'s variant in this fresh process; prints its peak above the start."""
    lm, pad_id, prompts, cands, autocast = setting(a)
    with open("/proc/self/clear_refs", "w") as f:  # resets the peak (VmHWM)
        f.write("5")
    before, _ = rss_mb()
    call(lm, pad_id, prompts, cands, autocast, a.child)
    print(json.dumps({"peak_mb": rss_mb()[1] - before}))


def peak_in_fresh_process(argv: list[str], variant: str) -> int | None:
    if not os.access("/proc/self/clear_refs", os.W_OK):
        return None
    out = subprocess.run([sys.executable, "-m", "hieragent.bench.attention", *argv, "--child", variant],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=16, help="turns per forward (the config's micro_batch_turns)")
    p.add_argument("--prompt", type=int, default=200, help="the longest prompt, in tokens")
    p.add_argument("--candidates", type=int, default=12, help="candidates per turn (a GoToLocal planner's)")
    p.add_argument("--candidate-tokens", type=int, default=6, help="the longest candidate, in tokens")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--precision", default=None, help="a Lightning precision; default: what fit would choose")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny random model, small sizes (the test)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.turns, a.prompt, a.candidates, a.candidate_tokens, a.reps = 4, 24, 3, 3, 2
    reason = "given"
    if a.precision is None:
        a.precision, reason = resolve_precision("cpu")
    if a.child is not None:
        child(a)
        return {}
    # the children get this run's arguments, with the precision chosen here (the last one wins)
    shared = [*(sys.argv[1:] if argv is None else argv), f"--precision={a.precision}"]
    # the fresh processes first, while this one holds no model (on 24 GB, an fp32 SmolLM2
    # child beside a parent that had run the full-logit variants was killed for memory)
    peaks = {v: peak_in_fresh_process(shared, v) for v in VARIANTS}
    lm, pad_id, prompts, cands, autocast = setting(a)
    first = {v: call(lm, pad_id, prompts, cands, autocast, v) for v in VARIANTS}  # warm-up
    base = next(iter(VARIANTS))
    gap = {v: max((x - y).abs().max().item() for x, y in zip(lps, first[base])) for v, lps in first.items()}
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in track(range(a.reps), description="bench-attention: timing"):
        for v in VARIANTS:
            start = time.perf_counter()
            call(lm, pad_id, prompts, cands, autocast, v)
            seconds[v].append(time.perf_counter() - start)
    median = {v: statistics.median(s) for v, s in seconds.items()}

    console = Console(width=max(Console().width, 120))
    table = Table(title=(f"bench-attention: {'tiny' if a.quick else 'smollm2'}, {a.turns} turns of up to "
                         f"{a.prompt} prompt tokens, {a.candidates} candidates each; precision {a.precision} "
                         f"({reason}); {os.cpu_count()} CPUs, torch {torch.__version__}"))
    for col in ("variant", "s per forward+backward (median)", f"vs {base}", "peak MB above start", f"vs {base}"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for v, (_, _, label) in VARIANTS.items():
        peak, base_peak = peaks[v], peaks[base]
        table.add_row(label, f"{median[v]:.3f}", f"{median[v] / median[base]:.2f}",
                      "n/a" if peak is None else str(peak),
                      "n/a" if peak is None or not base_peak else f"{peak / base_peak:.2f}")
    console.print(table)
    console.print("largest log-probability difference from the first: "
                  + ", ".join(f"{v} {gap[v]:.2e}" for v in VARIANTS if v != base))
    return {"seconds": seconds, "peak_mb": peaks, "gap": gap, "precision": a.precision}


if __name__ == "__main__":
    main()
