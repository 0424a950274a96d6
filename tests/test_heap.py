"""``hieragent.heap``: what a freeze keeps out of the collector's walks, and what it costs."""

import gc
import json
import subprocess
import sys
import weakref

import pytest

from hieragent import heap


class Node:
    def __init__(self) -> None:
        self.other = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture()
def thawed():
    """Each test starts and ends with nothing frozen."""
    heap.unfreeze()
    yield
    heap.unfreeze()


def test_freeze_counts_what_was_alive_and_a_walk_then_sees_only_what_came_after(thawed):
    kept = [[i] for i in range(20_000)]  # 20,001 container objects alive before the freeze
    frozen = heap.freeze()
    assert gc.get_freeze_count() == frozen >= 20_001
    later = [[i] for i in range(500)]
    walked = gc.get_objects()  # the generations a collection walks: what came after the freeze
    assert len(walked) < 20_000 and any(o is later for o in walked) and not any(o is kept for o in walked)
    heap.unfreeze()
    assert gc.get_freeze_count() == 0 and any(o is kept for o in gc.get_objects())


def test_cycles_made_after_the_freeze_are_collected_and_frozen_ones_wait_for_the_thaw(thawed):
    old = Node()
    old_ref = weakref.ref(old)
    heap.freeze()
    new = Node()
    new_ref = weakref.ref(new)
    del old, new
    gc.collect()
    assert new_ref() is None  # training's own garbage is collected as before
    assert old_ref() is not None  # the documented cost: a frozen cycle waits
    heap.unfreeze()
    gc.collect()
    assert old_ref() is None


def test_measure_thaws_what_it_froze_and_the_module_prints_json(thawed):
    got = heap.measure(reps=2)
    assert gc.get_freeze_count() == 0
    assert got["frozen"] > 0.9 * got["tracked"] and got["tracked_after"] < got["tracked"]
    assert got["live_ms"] > 0 and got["frozen_ms"] >= 0
    out = subprocess.run([sys.executable, "-m", "hieragent.heap", "--reps", "1"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    trainer = json.loads(out.stdout.splitlines()[-1])
    # the trainer's imports (torch, transformers, PEFT, Lightning, FAISS) are the objects a walk pays for
    assert trainer["tracked"] > 100_000 and trainer["frozen"] > 100_000 and trainer["tracked_after"] < 1000
