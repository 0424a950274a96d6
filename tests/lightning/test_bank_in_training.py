"""The bank inside a real `hieragent fit`: every change logged, metrics, index config, resume."""

import csv
import json

import torch

from cli_helpers import run_cli as run


def test_fit_logs_every_bank_change_and_resumes_with_the_configured_index(workspace):
    args = ["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", "3",
            "--model.memory.index.kind", "hnsw", "--model.memory.contrastive_coef", "0.5"]
    fit = run(args, workspace)
    assert fit.returncode == 0, fit.stderr[-3000:]
    version = workspace / "lightning_logs" / "tiny" / "version_0"
    ckpt = torch.load(version / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    bank = ckpt["hieragent"]["bank"]
    assert bank["index"]["kind"] == "hnsw" and bank["index_state"]["active"] == "hnsw"
    assert ckpt["hieragent"]["evolution"]["capacity"] == bank["capacity"]

    # replaying the change log over the seed entries gives exactly the checkpoint's bank
    changes = [json.loads(line) for line in open(version / "bank_changes.jsonl", encoding="utf-8")]
    assert changes and {c["op"] for c in changes} <= {"added", "merged", "evicted"}
    assert {c["kind"] for c in changes if c["op"] == "added"} <= {"skill", "lesson"}
    ids = {i for i, s in zip(bank["ids"].tolist(), bank["sources"]) if s.startswith("seed:")}
    for c in changes:
        if c["op"] == "added":
            ids.add(c["id"])
        elif c["op"] == "evicted":
            ids.discard(c["id"])
    assert ids == set(bank["ids"].tolist())
    added = {c["id"]: c for c in changes if c["op"] == "added"}
    for i, text, step in zip(bank["ids"].tolist(), bank["texts"], bank["created_steps"]):
        if i in added:
            assert added[i]["text"] == text and added[i]["step"] == step

    with open(version / "metrics.csv", newline="") as f:
        header = set(next(csv.reader(f)))
    for key in ("bank/size", "bank/size_lesson", "bank/added", "bank/merged", "bank/evicted",
                "bank/hit_rate", "bank/retrieval_ms_per_query", "bank/used_fraction"):
        assert key in header, key

    resume = run(["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", "4",
                  "--model.memory.index.kind", "flat", "--ckpt_path", str(version / "checkpoints" / "last.ckpt")],
                 workspace)
    assert resume.returncode == 0, resume.stderr[-3000:]
    # a setting given on resume wins over the checkpoint's, and the difference is named
    assert "resuming with model.memory.index.kind='flat'; the checkpoint was trained with 'hnsw'" in resume.stderr
    after = torch.load(sorted(workspace.glob("lightning_logs/tiny/version_*/checkpoints/last.ckpt"))[-1],
                       map_location="cpu", weights_only=False)["hieragent"]["bank"]
    # loaded into another index kind: every entry survived the rebuild, then training went on
    assert after["index_state"]["active"] == "flat"
    kept = set(bank["ids"].tolist()) & set(after["ids"].tolist())
    evicted_since = len(set(bank["ids"].tolist()) - kept)
    assert evicted_since == 0 and after["next_id"] >= bank["next_id"]
