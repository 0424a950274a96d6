"""``make bench-freeing --quick`` runs end to end, and its loans and its release thread each free
the restored copy in slices (nothing else holds it)."""

import math

from hieragent.bench.freeing import AFTER, WAYS, main, summary
from hieragent.memory import freeing


def test_each_way_hands_over_a_restored_index_and_the_loans_and_the_thread_free_it_in_slices(capsys):
    lists, pages, kept = freeing.freed["lists"], freeing.freed["pages"], freeing.freed["kept"]
    results = main(["--quick"])
    out = capsys.readouterr().out
    assert sorted(r["way"] for r in results) == sorted(WAYS)
    for r in results:
        assert r["steps"] >= AFTER and (r["freed_s"] >= 0 if r["way"] != "none" else math.isnan(r["freed_s"]))
        assert 0 < r["median_ms"] and r["handover_ms"] <= r["longest_ms"]
        assert abs(r["ratio"] - r["longest_ms"] / r["median_ms"]) < 1e-9 and 0 <= r["longest_at"] < r["steps"]
        assert (r["freeing_steps"] >= 1) == (r["way"] in ("loans", "thread"))  # freed after the hand-over step
    # two rounds handed their copy to the loans and to the thread: its IVF lists and its mapped rows went in slices
    assert (freeing.freed["lists"], freeing.freed["pages"], freeing.freed["kept"]) == (lists + 2, pages + 2, kept)
    for line in summary(results):
        assert line in out


def test_summary_says_when_the_ways_overlap():
    def rows(step, thread, none=()):
        return ([{"way": "step", "ratio": t} for t in step] + [{"way": "thread", "ratio": t} for t in thread]
                + [{"way": "none", "ratio": t} for t in none])

    apart = summary(rows([2.0, 2.4, 2.2], [1.2, 1.5, 1.3], [1.4, 1.25, 1.3]))
    assert apart[0] == ("in the step: longest step from the hand-over on, median 2.20x the median step over 3 rounds "
                        "(2.00-2.40x)")
    assert apart[-2] == ("release thread: every round's longest step was shorter than every round's of in the step")
    assert apart[-1] == ("none (kept) and release thread: the ranges overlap, a difference inside this machine's "
                         "noise")
    assert summary(rows([2.0, 1.4], [1.2, 1.5]))[-1].startswith("release thread and in the step: the ranges overlap")
    assert summary(rows([1.1], [1.5]))[-1] == ("in the step: every round's longest step was shorter than every "
                                               "round's of release thread")
    loans = summary(rows([2.0, 2.4], [], [1.3, 1.4]) + [{"way": "loans", "ratio": t} for t in (1.35, 1.5)])
    assert loans[-2:] == ["on loans: every round's longest step was shorter than every round's of in the step",
                          "none (kept) and on loans: the ranges overlap, a difference inside this machine's noise"]
