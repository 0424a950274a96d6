"""``hieragent bank list|search|export`` on a checkpoint holding a real MiniLM/FAISS bank."""

import ast
import json
from pathlib import Path

import pytest
import torch

import hieragent.memory
from cli_helpers import run_cli, run_cli_here
from hieragent.memory.bank import MemoryBank

TEXTS = ["mission: go to the red ball. plan: go to the red ball",
         "mission: open the blue door. plan: go to the blue door, open the blue door",
         "mission: pick up the green key. plan: go to the green key, pick up the green key"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    bank = MemoryBank(capacity=10)
    ids = bank.add(TEXTS, kind="skill", source="test", step=3)
    bank.record_use([ids[1]], 1.0)
    bank.record_use([ids[2]], 0.5)
    path = tmp_path_factory.mktemp("ckpt") / "last.ckpt"
    torch.save({"state_dict": {}, "hieragent": {"bank": bank.state_dict()}}, path)
    return path, bank


def test_export_writes_every_entry_exactly(checkpoint, tmp_path):
    path, bank = checkpoint
    out = run_cli(["bank", "export", "--ckpt_path", str(path), "--out", str(tmp_path / "b.jsonl")], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert rows == [bank.entry(i) for i in bank.ids()]
    assert [r["uses"] for r in rows] == [0, 1, 1] and rows[1]["utility"] == 1.0


def test_list_sorts_by_utility_and_search_finds_the_nearest_key(checkpoint, tmp_path, monkeypatch, capsys):
    path, _ = checkpoint
    listed = run_cli_here(["bank", "list", "--ckpt_path", str(path), "--sort", "utility"], tmp_path,
                          monkeypatch, capsys)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert listed.stdout.index("open the blue door") < listed.stdout.index("pick up the green key") \
        < listed.stdout.index("go to the red ball")  # utilities 1.0, 0.5, 0.0
    found = run_cli_here(["bank", "search", "--ckpt_path", str(path), "--query", "open a blue door", "--k", "1"],
                         tmp_path, monkeypatch, capsys)
    assert found.returncode == 0, found.stderr[-2000:]
    assert "open the blue door" in found.stdout and "red ball" not in found.stdout


def test_a_checkpoint_without_a_bank_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    path = tmp_path / "flat.ckpt"
    torch.save({"state_dict": {}, "hieragent": {"bank": None}}, path)
    out = run_cli_here(["bank", "list", "--ckpt_path", str(path)], tmp_path, monkeypatch, capsys)
    assert out.returncode == 2 and "holds no memory bank" in out.stderr and "Traceback" not in out.stderr
    missing = run_cli_here(["bank", "list", "--ckpt_path", str(tmp_path / "nope.ckpt")], tmp_path, monkeypatch, capsys)
    assert missing.returncode == 2 and "nope.ckpt" in missing.stderr


def test_memory_imports_no_stage_above_it():
    for path in Path(hieragent.memory.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(("hieragent.rollout", "hieragent.lightning")), \
                    f"{path.name} imports {node.module}"
