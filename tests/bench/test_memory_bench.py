"""``make bench-memory`` runs end to end at toy sizes and prints every index row."""

import gc
import math
import statistics
import os
import subprocess
import sys

import numpy as np
import pytest

from hieragent.bench import bank_upkeep
from hieragent.bench.memory import EXACT, cluster_source, main, mission_texts, numpy_topk, recall_at_k
from hieragent.isa import ISA_ENV
from hieragent.memory.structures import IndexSpec


def test_bench_prints_every_index_and_exact_paths_agree(capsys):
    rows = main(["--quick", "--spinner"])
    out = capsys.readouterr().out
    for name in ("the fixed step beside a process spinning at niceness 10", "niceness 19", *EXACT, "IVF128,Flat",
                 "IVF128,PQ48x4fs", "HNSW32", "bank KeyIndex (auto)", "finding",
                 "goal (clustered n=2,000)", "matmul peak fp32", "bank upkeep per training update",
                 "goal (upkeep n=2,000", "stall (n=2,000, retrain inline", "stall (n=2,000, retrain thread",
                 "stall (n=2,000, retrain lent", "the 5 longest steps of each stall run, by part"):
        assert name in out
    bank = [r for r in rows if r.index == "bank KeyIndex (auto)"]
    assert len(bank) == 2 and all(r.recall == 1.0 and r.params.startswith("flat") for r in bank)  # 2k keys: exact
    for data in ("clustered", "uniform"):
        exact = [r for r in rows if r.data == data and r.exact]
        assert len(exact) == len(EXACT)
        # every exact path is scored against the numpy result: they must find the same top 10
        assert all(r.recall == 1.0 for r in exact)
        ivf = [r for r in rows if r.data == data and r.index.endswith(",Flat")]
        assert len(ivf) == 4
        # more lists probed can only find more of the true top 10, and probing few is lossy
        assert [r.recall for r in ivf] == sorted(r.recall for r in ivf)
        if data == "uniform":  # no clusters to find: 8 of ~180 lists miss most neighbours
            assert ivf[0].recall < 0.9
        assert all(r.batch_ms > 0 and math.isfinite(r.batch_ms) for r in exact + ivf)
    fastscan = [r for r in rows if r.data == "clustered" and "x4fs" in r.index]
    assert len(fastscan) == 4 and {r.index for r in fastscan} == {"IVF128,PQ48x4fs", "IVF128,PQ192x4fs"}
    assert all(r.recall >= 0.9 for r in fastscan)  # re-scored exactly: near-exact
    projected = [r for r in rows if r.data == "clustered" and r.index == "HNSW16 over 96 directions"]
    assert [r.params for r in projected] == [f"efSearch {e}, re-scored" for e in (12, 16, 24)]
    assert all(0 < r.recall <= 1 and r.batch_ms > 0 for r in projected)


def test_bench_restarts_itself_capped_at_avx2_and_says_so():
    env = {k: v for k, v in os.environ.items() if k != ISA_ENV}
    out = subprocess.run([sys.executable, "-m", "hieragent.bench.memory", "--quick", "--isa", "avx2", "--no-upkeep",
                          "--uniform-size", "0"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    machine = [line for line in out.stdout.splitlines() if line.startswith("machine: ")]
    assert machine and "capped at avx2 (MKL_ENABLE_INSTRUCTIONS=AVX2" in machine[0]
    assert "bank KeyIndex (auto)" in out.stdout and "goal (clustered n=2,000)" in out.stdout


def test_upkeep_keeps_a_full_bank_full_and_a_background_retrain_never_stops_the_steps():
    draw = cluster_source(3000, seed=5)
    bank, timings, _ = bank_upkeep.upkeep(draw(3000), draw, seed=5, updates=4)
    assert len(bank) == 3000 and bank.events["evicted"] > 0 and bank.events["added"] == 5 * bank_upkeep.EPISODES
    assert len(timings.retrieval_ms) == len(timings.metrics_ms) == 4 and min(timings.totals()) > 0
    state = bank.state_dict()
    spec = IndexSpec(kind="ivf_flat", nlist=16)
    inline = bank_upkeep.stall(state, draw, "inline", seed=5, spec=spec, step_ms=5.0, baseline=4)
    assert inline.during == 1 and math.isfinite(inline.rebuild_s) and math.isnan(inline.cpu_s)
    for mode, freeze in (("thread", False), ("lent", True)):
        behind = bank_upkeep.stall(state, draw, mode, seed=5, spec=spec, step_ms=5.0, baseline=4, freeze=freeze)
        assert gc.get_freeze_count() == 0  # a frozen loop thaws at its end
        assert behind.mode == bank_upkeep.MODES[mode] + ("" if freeze else ", heap live")
        assert math.isfinite(behind.rebuild_s) and behind.cpu_s > 0  # its own thread or process did the work
        # a lent build names the longest slice of each stage it ran in the training thread
        assert (set(behind.slices) >= {"copy", "start", "result", "fill", "map"}) == (mode == "lent")
        assert all(ms > 0 for ms in behind.slices.values())
        # the retrain started after 4 updates of adds, steps went on until it was swapped in, then it was over
        assert behind.rebuilding.index(True) == 3 and behind.during >= 2
        assert behind.rebuilding[-5:] == [True] + [False] * 4  # the swap step, then 4 steps with no rebuild
        # the parts are spans inside each step, GC taken out of each and counted once
        assert set(behind.parts) == set(bank_upkeep.PARTS)
        assert all(len(v) == len(behind.steps) for v in behind.parts.values())
        sums = [sum(parts) for parts in zip(*behind.parts.values())]
        assert all(s <= t for s, t in zip(sums, behind.steps)) and sum(sums) > 0.9 * sum(behind.steps)
        assert min(behind.parts["work"]) > 0 and min(behind.parts["gc"]) >= 0
        verdict = bank_upkeep.verdicts([], [behind])[0]
        assert f"retrain {behind.mode})" in verdict and ("(met: <= 2x)" in verdict or "(not met" in verdict)
        assert ("longest slice in the training thread, by stage (ms; lent.LentBuild): copy " in
                "\n".join(bank_upkeep.verdicts([], [behind]))) == (mode == "lent")
        over = sum(t > 2 * statistics.median(t for t, r in zip(behind.steps, behind.rebuilding) if not r)
                   for t in behind.steps)
        assert f", {over} of {len(behind.steps)} steps above 2x (" in verdict and (over > 0) == (behind.ratio > 2)
    with pytest.raises(ValueError, match="stall mode 'idle' is unknown; expected one of inline, thread, lent"):
        bank_upkeep.stall(state, draw, "idle", seed=5, spec=spec)
    # capped before its rebuild was swapped in (here: before it began), a run cannot vouch for the swap step
    capped = bank_upkeep.stall(state, draw, "thread", seed=5, spec=spec, step_ms=5.0, max_steps=3)
    assert len(capped.steps) == 3 and math.isnan(capped.rebuild_s)
    assert "not shown: the rebuild had not finished after 3 steps" in bank_upkeep.verdicts([], [capped])[0]


def test_the_upkeep_bank_is_built_in_a_child_and_loads_here_with_its_index():
    draw = cluster_source(2500, seed=3)
    keys = draw(2500)
    bank = bank_upkeep.saved_bank(keys, seed=3, spec=IndexSpec(kind="ivf_flat", nlist=16, nprobe=4))
    state = bank_upkeep.bank_state(keys, seed=3)
    assert bank.ids() == list(range(2500)) and bank.keys(bank.ids()).tobytes() == keys.tobytes()
    assert [bank.utility(i) for i in range(0, 2500, 97)] == state["utilities"][::97]
    assert bank.index_kind == "ivf_flat" and bank._index.rows == 2500 and bank._index.trained_at == 2500
    assert bank._index.ops["rebuilds"] == 0  # the child's index, loaded: nothing was built in this process
    ids, scores = bank.search(keys[:5], 3)
    assert ids[:, 0].tolist() == [0, 1, 2, 3, 4] and np.allclose(scores[:, 0], 1.0, atol=1e-5)


def test_mission_texts_are_distinct_and_seeded():
    texts = mission_texts(500, seed=0)
    assert len(set(texts)) == 500
    assert texts == mission_texts(500, seed=0) != mission_texts(500, seed=1)


def test_recall_counts_true_neighbours_found_ignoring_padding_and_order():
    truth = np.array([[0, 1, 2, 3], [4, 5, 6, 7]])
    found = np.array([[3, 2, 9, -1], [7, 6, 5, 4]])  # 2 of 4 (one slot unfilled), then 4 of 4
    assert recall_at_k(found, truth) == 6 / 8
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 8)).astype(np.float32)
    q = rng.standard_normal((20, 8)).astype(np.float32)
    exact = numpy_topk(x, q)
    brute = np.argsort(-(q.astype(np.float64) @ x.T.astype(np.float64)), axis=1)[:, : exact.shape[1]]
    assert recall_at_k(exact, brute) == 1.0
    shifted = np.where(np.arange(exact.shape[1]) < 3, exact, -1)  # keep the first 3 of each row
    assert recall_at_k(shifted, brute) == 3 / exact.shape[1]


def test_gc_pauses_count_collections_only_while_installed():
    pauses = bank_upkeep.GcPauses()
    junk = [[i] for i in range(200_000)]  # something for a full collection to walk
    gc.collect()
    assert pauses.ms == 0.0
    with pauses:
        gc.collect()
    inside = pauses.ms
    gc.collect()
    assert inside > 0 and pauses.ms == inside and bank_upkeep.NO_GC.ms == 0.0 and junk


def test_stall_attributes_each_long_step_to_the_part_most_over_its_median():
    rng = np.random.default_rng(11)
    n = 400
    parts = {p: list(rng.gamma(2.0, 10.0, n)) for p in bank_upkeep.PARTS}
    for i in rng.choice(n, 40, replace=False):  # long steps, each from one part
        parts[bank_upkeep.PARTS[i % len(bank_upkeep.PARTS)]][i] += rng.uniform(50, 400)
    steps = [sum(v[i] for v in parts.values()) + rng.uniform(0, 0.1) for i in range(n)]
    rebuilding = list(rng.random(n) < 0.7)
    r = bank_upkeep.Stall("lent (process on loans)", 1000, steps, rebuilding, 1.0, parts=parts)
    quiet = [i for i in range(n) if not rebuilding[i]]
    med = {p: float(np.median(np.array(v, dtype=np.float64)[quiet])) for p, v in parts.items()}
    step_med = float(np.median(np.array(steps, dtype=np.float64)[quiet]))
    long = [i for i in range(n) if steps[i] > 2 * step_med]
    want = {}
    for i in long:
        cause = max(bank_upkeep.PARTS, key=lambda p: parts[p][i] - med[p])
        want[cause] = want.get(cause, 0) + 1
    assert long and dict(r.causes()) == want and r.over == len(long)
    own = [i for i in long if steps[i] - max(0.0, parts["work"][i] - med["work"]) > 2 * step_med]
    assert r.bank_over == len(own) < len(long)  # the long workloads are not the bank's
    line = bank_upkeep.verdicts([], [r])[0]
    assert f"{len(own)} still above 2x with the workload at its median time (the bank's own parts: not met)" in line
