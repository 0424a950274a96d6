"""``make bench-openmp --quick`` runs end to end: one process per import order, each reporting
the runtimes it really had."""

from hieragent.bench.openmp import ORDERS, main, summary


def test_each_order_runs_in_its_own_process_with_the_runtimes_it_says(capsys):
    results = main(["--quick"])
    out = capsys.readouterr().out
    assert sorted(r["order"] for r in results) == sorted(ORDERS)
    for r in results:
        assert r["one_runtime"] == (r["order"] == "torch")  # measured in the child, not assumed
        assert 0 < r["retrieval_ms"] <= r["total_ms"] <= r["max_ms"]
    for line in summary(results):
        assert line in out


def test_summary_says_when_the_orders_overlap():
    def rows(two, one):
        return [{"order": "faiss", "total_ms": t} for t in two] + [{"order": "torch", "total_ms": t} for t in one]

    apart = summary(rows([50, 60, 55], [30, 40, 35]))
    assert apart[-2:] == ["two runtimes / one: 1.57x",
                          "every process with one runtime was faster than every process with two"]
    assert "FAISS first (two runtimes): median 55.0 ms over 3 processes (50.0-60.0)" in apart
    assert summary(rows([50, 60, 55], [30, 52, 35]))[-1] == ("the two orders: the ranges overlap, a difference "
                                                             "inside this machine's noise")
    assert summary(rows([30, 31], [40, 41]))[-1] == ("every process with two runtimes was faster than every "
                                                     "process with one")
