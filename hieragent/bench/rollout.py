"""``make bench-rollout``: how fast does the engine act, against the naive ways and the machine?

One BabyAI-GoToLocal batch (``--envs`` envs, 8 and 32 by default) is played for
``--turns`` executor turns per episode by SmolLM2-135M with planner and executor adapters
and the seeded skill bank (real FAISS retrieval with MiniLM embeddings), through the HF
engine, in ``score`` and ``generate`` mode, without history and with a ``--history``-turn
window. In the same run, on fewer envs and turns (``--baseline-envs``, ``--baseline-turns``):

* ``naive score``: one env at a time, every candidate re-forwarded with its whole prompt;
* ``naive generate``: ``transformers`` ``generate``, one env at a time, the whole prompt
  (history included) prefilled again at every turn.

Columns: turns per second over the whole rollout (envs, retrieval and acting); prompt
tokens per turn (the prompt the policy sees), those taken from the engine's KV cache, and
the tokens the engine actually ran per turn (new prompt tokens, candidates, decoded
tokens); the
engine's achieved GFLOP/s (weight matmuls of the tokens run, the vocabulary rows used, and
attention over the keys each query sees, 2 flops per multiply-add; padding and the
positions a mask hides are not counted, so it is a lower bound) and
its share of the machine's matmul peak in the same precision, measured in this run; the
speed-up over the naive row of the same mode; and, with history, the cost of the last turn
over the first (engine seconds per env at executor turn ``--turns`` over turn 1).

Precision is the one ``hieragent fit`` would choose here (``hieragent.precision``), unless
``--precision`` says otherwise. ``--quick`` runs the tiny random model on 2 envs (the test).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hieragent.agents.policy import Executor, Planner
from hieragent.agents.scoring import token_logprobs
from hieragent.engines.acting import Agent
from hieragent.engines.base import Engine, EngineSettings, finished
from hieragent.engines.hf import HFEngine, causal_pairs
from hieragent.engines.prompting import Prompter
from hieragent.envs.pool import EnvPool
from hieragent.memory.bank import MemoryBank
from hieragent.memory.settings import MemorySettings
from hieragent.models.loading import load_causal_lm, load_tokenizer
from hieragent.models.lora import LoraSettings, add_adapters
from hieragent.precision import autocast_dtype, cast_for, fastest, matmul_peak, resolve_precision
from hieragent.rollout.loop import RolloutSettings, collect

REPO = Path(__file__).resolve().parents[2]
LEVEL = "BabyAI-GoToLocal-v0"


# -- the machine ---------------------------------------------------------------------
def attention_peak(dtype: torch.dtype, rows: int = 8, queries: int = 194, keys: int = 2000,
                   seconds: float = 1.0) -> float:
    """Best GFLOP/s of masked SDPA in ``dtype`` at a history turn's shape (SmolLM2's 3 KV heads
    of 3 query heads each, ``queries`` new tokens per row over ``keys`` keys), now."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, 3, 3 * queries, 64, generator=g).to(dtype)
    k = torch.randn(rows, 3, keys, 64, generator=g).to(dtype)
    mask = torch.ones(rows, 1, 3 * queries, keys, dtype=torch.bool)
    seconds_per_call = fastest(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask),
                               seconds)
    return 4 * rows * 9 * queries * keys * 64 / seconds_per_call / 1e9


def forward_seconds(lm, autocast: torch.dtype | None, rows: int = 8, length: int = 128) -> float:
    """Best of 3 forwards over ``rows x length`` tokens (no grad), under ``autocast``."""
    ids = torch.randint(0, 1000, (rows, length), generator=torch.Generator().manual_seed(0))
    ctx = torch.autocast("cpu", dtype=autocast) if autocast is not None else nullcontext()
    best = float("inf")
    with torch.no_grad(), ctx:
        lm(input_ids=ids, logits_to_keep=1)
        for _ in range(3):
            start = time.perf_counter()
            lm(input_ids=ids, logits_to_keep=1)
            best = min(best, time.perf_counter() - start)
    return best


# -- the baselines -------------------------------------------------------------------
class NaiveEngine(Engine):
    """Acting as a first implementation would: one env at a time, no cache shared."""

    name = "naive"

    def __init__(self, lm, pad_id: int, eos_id: int, autocast: torch.dtype | None = None) -> None:
        super().__init__(EngineSettings())
        self.lm, self.pad_id, self.eos_id, self.autocast = lm, pad_id, eos_id, autocast
        self.computed = self.logit_rows = self.attended = 0

    def _ctx(self):
        return torch.autocast("cpu", dtype=self.autocast) if self.autocast is not None else nullcontext()

    @torch.no_grad()
    def score(self, requests, continuations):
        self.lm.set_adapter(requests[0].adapter)
        out = []
        with self._ctx():
            for r, cands in zip(requests, continuations):
                row = []
                for c in cands:  # the whole prompt again for every candidate
                    logits = self.lm(input_ids=torch.tensor([r.prompt_ids + c])).logits[0]
                    row.append(token_logprobs(logits[len(r.prompt_ids) - 1:-1], torch.tensor(c)).float())
                    self.computed += len(r.prompt_ids) + len(c)
                    self.logit_rows += len(c)
                    self.attended += causal_pairs(len(r.prompt_ids) + len(c))
                out.append(row)
        return out

    @torch.no_grad()
    def generate(self, requests, generator=None):
        self.lm.set_adapter(requests[0].adapter)
        s = requests[0].sampling
        out = []
        with self._ctx():
            for r in requests:  # the whole prompt, history included, prefilled again
                ids = torch.tensor([r.prompt_ids])
                res = self.lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                       do_sample=not s.greedy, temperature=s.temperature, top_k=0, top_p=1.0,
                                       max_new_tokens=s.max_new_tokens, output_logits=True,
                                       return_dict_in_generate=True, pad_token_id=self.pad_id,
                                       eos_token_id=self.eos_id)
                new = res.sequences[0, ids.shape[1]:]
                lps = token_logprobs(torch.stack(res.logits, 1)[0], new, s.temperature)
                row = new.tolist()
                out.append(finished(row, lps.tolist(), self.eos_id))
                self.computed += len(r.prompt_ids) + len(row) - 1
                self.logit_rows += len(row)
                self.attended += causal_pairs(len(r.prompt_ids) + len(row) - 1)
        return out


class Timed:
    """An engine with its calls timed, per call: adapter, rows, seconds."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _timed(self, fn, requests, *args):
        start = time.perf_counter()
        out = fn(requests, *args)
        self.calls.append((requests[0].adapter if requests else "", len(requests), time.perf_counter() - start))
        return out

    def score(self, requests, continuations):
        return self._timed(self.engine.score, requests, continuations)

    def generate(self, requests, generator=None):
        return self._timed(self.engine.generate, requests, generator)


# -- one row -------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    mode: str
    envs: int
    history: int
    turns: int
    seconds: float
    engine_seconds: float
    prompt_tokens: float  # per turn
    run_tokens: float  # per turn
    reused_tokens: float  # per turn: prompt tokens taken from the cache
    gflops: float
    turns_per_s: float = 0.0
    peak_share: float = 0.0
    speedup: float | None = None
    last_over_first: float | None = None
    executor_call_seconds: list = field(default_factory=list)


def run_row(name, lm, tokenizer, bank, mode, envs, turns, history, naive, autocast, flop_token, flop_logit,
            flop_pair, seed=0) -> Row:
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    engine = NaiveEngine(lm, pad, eos, autocast) if naive else HFEngine(lm, pad, eos, EngineSettings(), 0, autocast)
    timed = Timed(engine)
    planner = Planner(mode=mode, score_reduction="mean", embed_dim=384)
    executor = Executor(mode=mode, score_reduction="mean")
    for policy in (planner, executor):
        policy.bind(lm, tokenizer)
    agent = Agent(timed, Prompter(tokenizer, history), executor, planner, bank)
    settings = RolloutSettings(max_subgoal_steps=6, retrieval_candidates=4, retrieval_k=1, history=history)
    pool = EnvPool.make(LEVEL, envs, max_steps=turns)
    seeds = [1000 + seed * 100 + i for i in range(envs)]
    start = time.perf_counter()
    trajectories = collect(pool, seeds, seeds, agent, settings, generator=torch.Generator().manual_seed(seed))
    seconds = time.perf_counter() - start
    all_turns = [t for tr in trajectories for t in tr.turns]
    counts = engine if naive else engine.stats
    computed, logit_rows = counts.computed, counts.logit_rows
    engine_seconds = sum(c[2] for c in timed.calls)
    flops = computed * flop_token + logit_rows * flop_logit + counts.attended * flop_pair
    exec_calls = [c[2] / c[1] for c in timed.calls if c[0] == "executor"]  # seconds per env, per turn
    return Row(name, mode, envs, history, len(all_turns), seconds, engine_seconds,
               statistics.mean(len(t.prompt_ids) for t in all_turns), computed / len(all_turns),
               0.0 if naive else engine.stats.reused / len(all_turns),
               flops / engine_seconds / 1e9, turns_per_s=len(all_turns) / seconds,
               executor_call_seconds=exec_calls)


def table(rows: list[Row], title: str) -> Table:
    t = Table(title=title)
    for col in ("row", "mode", "envs", "history", "turns", "turns/s", "prompt tok/turn", "cached tok/turn", "run tok/turn",
                "GFLOP/s", "% of peak", "× naive", "last/first turn"):
        t.add_column(col, justify="left" if col in ("row", "mode") else "right")
    for r in rows:
        t.add_row(r.name, r.mode, str(r.envs), str(r.history), str(r.turns), f"{r.turns_per_s:.2f}",
                  f"{r.prompt_tokens:.0f}", f"{r.reused_tokens:.0f}", f"{r.run_tokens:.0f}", f"{r.gflops:.1f}", f"{100 * r.peak_share:.0f}%",
                  "" if r.speedup is None else f"{r.speedup:.1f}×",
                  "" if r.last_over_first is None else f"{r.last_over_first:.2f}")
    return t


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--envs", type=int, nargs="+", default=[8, 32])
    p.add_argument("--turns", type=int, default=10, help="executor turns per episode (the env's step cap)")
    p.add_argument("--history", type=int, default=10)
    p.add_argument("--baseline-envs", type=int, default=4)
    p.add_argument("--baseline-turns", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=["score", "generate"])
    p.add_argument("--precision", default=None, help="a Lightning precision; default: what fit would choose")
    p.add_argument("--quick", action="store_true", help="tiny random model, 2 envs, 3 turns (the test)")
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    a = p.parse_args(argv)
    if a.quick:
        a.envs, a.turns, a.history, a.baseline_envs, a.baseline_turns = [2], 3, 2, 1, 2
    precision, reason = (a.precision, "given") if a.precision else resolve_precision("cpu")
    autocast = autocast_dtype(precision)
    model = "tiny" if a.quick else "smollm2"
    tokenizer = load_tokenizer(model)
    lm = add_adapters(load_causal_lm(model, seed=0), ["planner", "executor"], LoraSettings(r=8, alpha=16))
    lm = cast_for(lm, precision)
    lm.eval()
    config = lm.get_base_model().config
    base = sum(p.numel() for n, p in lm.named_parameters() if "embed_tokens" not in n and "lora_" not in n)
    flop_token = 2 * base  # lm_head is tied to the embedding; its rows are counted apart
    flop_logit = 2 * config.vocab_size * config.hidden_size
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    flop_pair = 4 * config.num_attention_heads * head_dim * config.num_hidden_layers  # q.k and p.v, every layer
    memory = MemorySettings()
    bank = MemoryBank(memory.embedder, memory.capacity, memory.merge_threshold, memory.index)
    bank.seed_from_jsonl(REPO / memory.seed_file)

    console = Console(width=max(Console().width, 150))
    dtype = autocast or next(lm.parameters()).dtype
    peak = matmul_peak(dtype)
    peaks = {"float32": matmul_peak(torch.float32), "bfloat16": matmul_peak(torch.bfloat16, seconds=0.5)}
    forwards = {"32-true": forward_seconds(lm, None), "bf16-mixed": forward_seconds(lm, torch.bfloat16)}
    attention = {"float32": attention_peak(torch.float32), "bfloat16": attention_peak(torch.bfloat16)}
    plan = [("engine", m, n, a.turns, h, False) for n in a.envs for m in a.modes for h in (0, a.history)]
    plan += [(f"naive {m}", m, a.baseline_envs, a.baseline_turns, h, True) for m in a.modes
             for h in ((0,) if m == "score" else (a.history,))]
    rows: list[Row] = []
    with Progress(console=console) as progress:
        task = progress.add_task("bench-rollout", total=len(plan))
        for name, mode, envs, turns, history, naive in plan:
            progress.update(task, description=f"{name} {mode} envs={envs} history={history}")
            rows.append(run_row(name, lm, tokenizer, bank, mode, envs, turns, history, naive, autocast,
                                flop_token, flop_logit, flop_pair))
            progress.advance(task)
    for r in rows:
        r.peak_share = r.gflops / peak
        base_row = next((b for b in rows if b.name == f"naive {r.mode}"), None)
        if base_row is not None and r.name == "engine":
            r.speedup = r.turns_per_s / base_row.turns_per_s
        if r.history and len(r.executor_call_seconds) >= 2:
            r.last_over_first = r.executor_call_seconds[-1] / r.executor_call_seconds[0]
    title = (f"bench-rollout: {LEVEL}, {model}, precision {precision} ({reason}); matmul peak "
             f"{peak:.0f} GFLOP/s in {str(dtype).removeprefix('torch.')} (fp32 {peaks['float32']:.0f}, "
             f"bf16 {peaks['bfloat16']:.0f}); {os.cpu_count()} CPUs, torch {torch.__version__}")
    console.print(table(rows, title))
    console.print(f"forward of 8 x 128 tokens: fp32 {forwards['32-true']:.2f} s, bf16 autocast "
                  f"{forwards['bf16-mixed']:.2f} s ({forwards['32-true'] / forwards['bf16-mixed']:.2f}x); "
                  f"masked attention at a history turn's shape: fp32 {attention['float32']:.0f} GFLOP/s, "
                  f"bf16 {attention['bfloat16']:.0f} GFLOP/s")
    result = {"level": LEVEL, "model": model, "precision": precision, "reason": reason, "peak_gflops": peak,
              "peaks": peaks, "attention_gflops": attention, "forward_seconds": forwards, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "rows": [asdict(r) for r in rows]}
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=a.out.parent, delete=False, suffix=".tmp") as f:
            json.dump(result, f, indent=1)
        os.replace(f.name, a.out)
    return result


if __name__ == "__main__":
    main()
