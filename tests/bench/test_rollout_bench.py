"""``make bench-rollout --quick`` runs end to end, and its numbers show the cache at work:
the engine runs fewer tokens per turn than naive acting, and with history fewer than the
prompt holds."""

import json

from hieragent.bench.rollout import main


def test_quick_bench_rollout_runs_and_the_cache_saves_tokens(tmp_path):
    out = tmp_path / "bench.json"
    result = main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    rows = {(r["name"], r["mode"], r["history"]): r for r in result["rows"]}
    assert set(rows) == {("engine", m, h) for m in ("score", "generate") for h in (0, 2)} | {
        ("naive score", "score", 0), ("naive generate", "generate", 2)}
    assert result["peak_gflops"] > 0 and all(r["gflops"] > 0 and r["turns"] > 0 for r in rows.values())
    # naive scoring re-runs the prompt for every candidate; the engine runs it once
    assert rows["engine", "score", 0]["run_tokens"] < 0.5 * rows["naive score", "score", 0]["run_tokens"]
    # with history the prompt grows but the engine runs only what the cache lacks
    for mode in ("score", "generate"):
        hist = rows["engine", mode, 2]
        assert hist["prompt_tokens"] > rows["engine", mode, 0]["prompt_tokens"]
        flat = rows["engine", mode, 0]
        assert flat["reused_tokens"] > 0  # the system block, at least
        # turn 1 has nothing to reuse; from turn 2 on the whole previous prompt is reused
        share = hist["reused_tokens"] / hist["prompt_tokens"]
        assert share > 0.3 and share > flat["reused_tokens"] / flat["prompt_tokens"]
    naive = rows["naive generate", "generate", 2]
    assert naive["run_tokens"] > naive["prompt_tokens"]  # the whole history, prefilled again
