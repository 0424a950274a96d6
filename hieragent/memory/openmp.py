"""torch and FAISS on one OpenMP runtime, and a warning where a process has two.

The faiss-cpu wheel carries its own copy of libgomp, and torch carries another. torch puts
its copy in the process's global symbol scope, so a FAISS imported after torch binds its
OpenMP calls to torch's copy, and one pool of threads runs both libraries' parallel work. A
FAISS imported before torch keeps its own copy: two pools on the same cores. libgomp's idle
threads spin for a while before they sleep (``GOMP_SPINCOUNT``, 300,000 turns by default),
so when the bank searches right after torch's work (the query adapter, a training step),
torch's idle thread spins on a core that FAISS's threads need, and the other way round.
(With two pools, ``GOMP_SPINCOUNT=10000`` or ``OMP_WAIT_POLICY=PASSIVE`` in the environment
took most of the difference back in a one-process probe: 39 ms an update, against 56-61.)

On the 2-core EPYC, ``make bench-openmp`` (fresh processes loading the same saved 1M bank,
alternating) measured a bank update at a median of 59.3 ms with two pools (58.5-64.9 over
three processes) and 38.7 ms with one (29.7-39.6): 1.53x. hieragent's entry
points (the CLI, the benches) import torch first; ``check`` warns once in a process that
imported FAISS first (a notebook that ran ``import faiss`` before torch, say).
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)


def one_runtime() -> bool:
    """Whether FAISS's OpenMP calls go to torch's runtime: a thread count set through torch is
    the count FAISS reads (each runtime keeps its own)."""
    import faiss
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(n + 1)
    try:
        return faiss.omp_get_max_threads() == n + 1
    finally:
        torch.set_num_threads(n)


@functools.cache
def check() -> bool:
    """``one_runtime()``, asked once per process (the binding is fixed once both libraries are
    loaded, and the bank imports both), with a warning where it is false. Only where torch's
    threads are OpenMP's (its Linux builds): elsewhere nothing is shared to check."""
    import torch

    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return True
    one = one_runtime()
    if not one:
        log.warning("FAISS was imported before torch, so the two run separate OpenMP thread pools that slow "
                    "each other's work (the bank's update at 1M keys: 59 ms against 39 ms on a 2-core EPYC, "
                    "make bench-openmp); import torch before faiss (hieragent's CLI and benches do)")
    return one
