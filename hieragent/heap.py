"""Python's full garbage collections, kept off the training step.

A full (generation-2) collection walks every container object the process tracks. A trainer
has torch, transformers, PEFT, Lightning and FAISS imported: about half a million objects,
which one full collection takes 100-300 ms to walk on our 2-core machines. CPython starts one
whenever enough objects have survived since the last, so every so often one lands in a training
step, whatever the step does (the 1M bench of ``make bench-memory`` put two of its three
longest steps down to them).

Nearly all of those objects live as long as the process: modules, the model, the bank. Once
training starts, ``freeze`` collects once and moves everything alive into the collector's
permanent generation (``gc.freeze``), which no collection walks. Later full collections walk
only what training has made since. The cost: a reference cycle among frozen objects that
becomes garbage is not collected until ``unfreeze`` (objects freed by reference counting,
most of them, are freed as before).

``hieragent.lightning.callbacks.FrozenHeap`` does this in every ``hieragent fit``;
``python -m hieragent.heap`` measures a full collection in a fresh process that imports what
the trainer does, before and after the freeze (``make bench-memory`` prints it).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

# what ``hieragent fit`` imports: the CLI, the module, the datamodule and through them the bank
TRAINER_IMPORTS = ("hieragent.cli", "hieragent.lightning.datamodule", "hieragent.lightning.module")


def freeze() -> int:
    """Collect, then freeze everything alive; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze() -> None:
    """Give the frozen objects back to the collector (the oldest generation)."""
    gc.unfreeze()


@contextmanager
def frozen(enabled: bool = True) -> Iterator[None]:
    """``freeze`` on entry and ``unfreeze`` on exit, if ``enabled``."""
    if not enabled:
        yield
        return
    freeze()
    try:
        yield
    finally:
        unfreeze()


def full_collection_ms(reps: int = 5) -> float:
    """The median milliseconds of one full collection now, over ``reps`` of them."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        gc.collect()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def measure(reps: int = 5) -> dict[str, float]:
    """In this process: tracked objects and a full collection's ms, before and after ``freeze``
    (which it undoes)."""
    gc.collect()
    before = {"tracked": len(gc.get_objects()), "live_ms": full_collection_ms(reps)}
    with frozen():
        return {**before, "frozen": gc.get_freeze_count(), "tracked_after": len(gc.get_objects()),
                "frozen_ms": full_collection_ms(reps)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hieragent.heap",
                                description="A full garbage collection in a process with the trainer's imports, "
                                            "before and after gc.freeze, as JSON.")
    p.add_argument("--bare", action="store_true", help="without the trainer's imports")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    if not a.bare:
        for name in TRAINER_IMPORTS:
            importlib.import_module(name)
    print(json.dumps(measure(a.reps)))


if __name__ == "__main__":
    main()
