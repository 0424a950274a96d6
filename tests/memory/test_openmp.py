"""FAISS shares torch's OpenMP runtime when torch is imported first, as hieragent's entry points
import them; a process that imported FAISS first is told, once (``memory/openmp.py``)."""

import subprocess
import sys

import pytest

CHECK = """
import logging, sys
logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
from hieragent.memory.bank import MemoryBank
from hieragent.memory.openmp import one_runtime
from hieragent.memory.structures import IndexSpec
import torch
threads = torch.get_num_threads()
print(one_runtime())
MemoryBank(capacity=8, index=IndexSpec(kind="flat"))
MemoryBank(capacity=8, index=IndexSpec(kind="flat"))
assert torch.get_num_threads() == threads, "the check must leave torch's thread count as it was"
"""


def run(first: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", first + CHECK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.parametrize(("first", "one"), [("import faiss\nimport torch\n", False),
                                            ("import torch\nimport faiss\n", True),
                                            ("import hieragent.cli\nimport faiss\n", True),
                                            ("import hieragent.bench.memory\n", True)])
def test_faiss_shares_torch_runtime_only_when_torch_came_first(first, one):
    """torch first: a thread count set through torch is the one FAISS reads; FAISS first: FAISS
    keeps its own libgomp. The CLI and the memory bench load them in the order that shares."""
    done = run(first)
    assert done.stdout.split() == [str(one)]
    warnings = done.stderr.count("FAISS was imported before torch")
    assert warnings == (0 if one else 1), done.stderr  # once per process, however many banks
