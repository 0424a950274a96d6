"""bench-evictions' quick run: both ways run on real tables, and only the old way passes over
the whole table after its first fill."""

from __future__ import annotations

import pytest

from hieragent.bench import evictions


def test_quick_evictions_bench_scans_ahead_where_the_old_way_passes_again(capsys):
    results = evictions.main(["--quick"])
    out = capsys.readouterr().out
    assert [r["way"] for r in results] == ["scan", "pass"]
    scan, full = results
    # 300 updates of 64 evictions serve a 16384-entry pool more than once
    assert scan["passes"] == 1 and full["passes"] >= 2
    assert all(r["median_ms"] > 0 and r["longest_ms"] >= r["p99_ms"] >= r["median_ms"] for r in results)
    assert "evictions from a full table of 20,000 entries" in out and "longest update:" in out


def test_counts_below_one_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        evictions.main(["--rounds", "0"])
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err
