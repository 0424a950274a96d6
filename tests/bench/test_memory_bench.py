"""``make bench-memory`` runs end to end at toy sizes and prints every index row."""

import math

from hieragent.bench.memory import EXACT, main, mission_texts


def test_bench_prints_every_index_and_exact_paths_agree(capsys):
    rows = main(["--quick"])
    out = capsys.readouterr().out
    for name in (*EXACT, "IVF128,Flat", "HNSW32", "bank KeyIndex (auto)", "recommended large-bank default", "finding"):
        assert name in out
    bank = [r for r in rows if r.index == "bank KeyIndex (auto)"]
    assert len(bank) == 2 and all(r.recall == 1.0 and r.params.startswith("flat") for r in bank)  # 2k keys: exact
    for data in ("clustered", "uniform"):
        exact = [r for r in rows if r.data == data and r.exact]
        assert len(exact) == len(EXACT)
        # every exact path is scored against the numpy result: they must find the same top 10
        assert all(r.recall == 1.0 for r in exact)
        ivf = [r for r in rows if r.data == data and r.index.startswith("IVF")]
        assert len(ivf) == 4 and all(0.0 <= r.recall <= 1.0 for r in ivf)
        assert all(r.batch_ms > 0 and math.isfinite(r.batch_ms) for r in exact + ivf)


def test_mission_texts_are_distinct_and_seeded():
    texts = mission_texts(500, seed=0)
    assert len(set(texts)) == 500
    assert texts == mission_texts(500, seed=0) != mission_texts(500, seed=1)
