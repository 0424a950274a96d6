"""EntryTable: the bank's column arrays against plain Python over the same entries."""

from __future__ import annotations

import numpy as np
import pytest

from hieragent.memory import entries
from hieragent.memory.entries import KINDS, EntryTable


def filled(rng: np.random.Generator, n: int) -> tuple[EntryTable, dict[int, dict]]:
    """A table and the same entries as dicts, with ties in utility (many unused entries at 0)."""
    table, model = EntryTable(), {}
    for i in rng.permutation(10 * n)[:n].tolist():
        kind = KINDS[rng.integers(len(KINDS))]
        step = int(rng.integers(0, 5))
        table.add(i, kind, f"text {i}", f"src {i}", step)
        model[i] = {"id": i, "kind": kind, "text": f"text {i}", "source": f"src {i}", "created_step": step,
                    "uses": 0, "utility": 0.0, "merges": 0}
    for _ in range(3 * n):
        credit(rng, table, model, 3)
    return table, model


def credit(rng: np.random.Generator, table: EntryTable, model: dict[int, dict], k: int) -> None:
    """Credit ``k`` random entries with a return on a coarse grid (so utilities tie exactly)."""
    ids = rng.choice(list(model), k, replace=False).tolist()
    ret = float(rng.integers(-2, 3)) / 2
    table.credit(ids, ret)
    for i in ids:
        e = model[i]
        e["uses"] += 1
        e["utility"] += (ret - e["utility"]) / e["uses"]


def test_eviction_order_is_utility_then_step_then_id_as_a_full_sort_would_give():
    rng = np.random.default_rng(0)
    table, model = filled(rng, 400)
    order = sorted(model, key=lambda i: (model[i]["utility"], model[i]["created_step"], i))
    for count in (1, 7, 150, 399, 400, 1000):
        assert table.lowest(count) == order[:count]
    assert table.lowest(0) == []


def test_stats_equal_a_float64_pass_over_the_entries_and_survive_removal_and_slot_reuse():
    rng = np.random.default_rng(1)
    table, model = filled(rng, 300)
    for i in rng.choice(list(model), 120, replace=False).tolist():
        assert table.remove(i) == model.pop(i)
    for j in range(50):  # reuses the freed slots: the columns do not grow
        table.add(10_000 + j, "lesson", "new", "s", 9)
        model[10_000 + j] = {"id": 10_000 + j, "kind": "lesson", "text": "new", "source": "s",
                             "created_step": 9, "uses": 0, "utility": 0.0, "merges": 0}
    assert len(table._text) == 300 and len(table) == len(model) == 230  # 300 slots ever used, not 350
    stats = table.stats()
    used = np.array([e["utility"] for e in model.values() if e["uses"] > 0], dtype=np.float64)
    assert len(used) > 50 and np.ptp(used) > 0
    assert stats["bank/size"] == len(model)
    for kind in KINDS:
        assert stats[f"bank/size_{kind}"] == sum(e["kind"] == kind for e in model.values())
    assert stats["bank/used_fraction"] == pytest.approx(len(used) / len(model), abs=1e-12)
    for name, q in (("p10", 10), ("p50", 50), ("p90", 90)):
        assert stats[f"bank/utility_{name}"] == pytest.approx(np.percentile(used, q), abs=1e-12)
    assert stats["bank/utility_mean"] == pytest.approx(used.mean(), abs=1e-12)
    assert all(table.get(i) == e for i, e in model.items())


def test_unknown_ids_say_which_and_credit_skips_them_and_counts_a_repeat_once():
    table = EntryTable()
    table.add(3, "skill", "t", "s", 0)
    table.credit([3, 99], 1.0)  # 99 was never added (or evicted since): skipped
    assert table.get(3)["uses"] == 1 and table.utility(99) == 0.0
    table.credit([3, 99, 3], 0.0)  # listed twice in one call: one use
    assert table.get(3)["uses"] == 2 and table.utility(3) == 0.5 and table.stats()["bank/utility_mean"] == 0.5
    with pytest.raises(KeyError, match="no entry with id 99"):
        table.get(99)


def test_the_eviction_pool_stays_exact_through_adds_credits_and_evictions_beyond_its_size(monkeypatch):
    """A pool far smaller than the table, refilled many times: after every operation the
    eviction order is still what a full sort gives."""
    monkeypatch.setattr(entries, "POOL", 16)
    rng = np.random.default_rng(3)
    table, model = filled(rng, 400)
    next_id = 10_000
    for op in range(600):
        r = rng.random()
        if r < 0.4:  # credit: keys move up or down, in or out of the pool
            credit(rng, table, model, 2)
        elif r < 0.75:  # add: a fresh entry at utility 0, newer than all
            table.add(next_id, "skill", "t", "s", 5 + op)
            model[next_id] = {"id": next_id, "kind": "skill", "text": "t", "source": "s", "created_step": 5 + op,
                              "uses": 0, "utility": 0.0, "merges": 0}
            next_id += 1
        else:  # evict the first few, as the bank does
            for i in table.lowest(int(rng.integers(1, 4))):
                table.remove(i)
                del model[i]
        if op % 25 == 0 or op > 580:
            order = sorted(model, key=lambda i: (model[i]["utility"], model[i]["created_step"], i))
            assert table.lowest(40) == order[:40], op
    assert len(table) == len(model)


def test_refills_scan_ahead_in_slices_and_stay_exact_through_changes_mid_scan(monkeypatch):
    """With scans far shorter than the table, a refill spans many eviction calls while
    credits, adds, evictions and slot reuse go on; the order stays a full sort's, and after
    the first fill no call makes a full pass."""
    monkeypatch.setattr(entries, "POOL", 64)
    monkeypatch.setattr(entries, "SCAN", 50)
    rng = np.random.default_rng(7)
    table, model = filled(rng, 1500)
    passes, reads = [], []
    refill, first = table._refill, entries.first_keys
    monkeypatch.setattr(table, "_refill", lambda taken: (passes.append(len(taken)), refill(taken)))
    monkeypatch.setattr(entries, "first_keys", lambda u, *rest: (reads.append(len(u)), first(u, *rest))[1])
    next_id, scans = 100_000, 0
    for op in range(900):
        credit(rng, table, model, 3)
        for _ in range(2):  # adds reuse the slots evictions free
            table.add(next_id, "episodic", "t", "s", int(rng.integers(0, 8)))
            model[next_id] = {"id": next_id, "kind": "episodic", "text": "t", "source": "s",
                              "created_step": table.get(next_id)["created_step"], "uses": 0, "utility": 0.0,
                              "merges": 0}
            next_id += 1
        for i in table.lowest(2):
            order = sorted(model, key=lambda i: (model[i]["utility"], model[i]["created_step"], i))
            assert i in order[:2], op
            table.remove(i)
            del model[i]
        scans += table._scan is not None
        if op % 50 == 0:
            order = sorted(model, key=lambda i: (model[i]["utility"], model[i]["created_step"], i))
            assert table.lowest(10) == order[:10], op
    assert len(passes) == 1  # the first fill only
    # each call read a slice of the table: here the pool (an eighth: 8 ids, 2 a call) sets it, not SCAN
    assert scans > 100 and max(reads[1:]) < 64 + 1500 / 3
    assert len(table._text) < 1600  # the columns stayed the table's size


def test_a_filled_pool_serves_the_first_evictions_without_a_pass(monkeypatch):
    monkeypatch.setattr(entries, "POOL", 16)
    rng = np.random.default_rng(9)
    table, model = filled(rng, 300)
    table.fill_pool()  # as a bank does when it loads
    passes = []
    refill = table._refill
    monkeypatch.setattr(table, "_refill", lambda taken: (passes.append(taken), refill(taken)))
    order = sorted(model, key=lambda i: (model[i]["utility"], model[i]["created_step"], i))
    assert table.lowest(5) == order[:5] and passes == []
