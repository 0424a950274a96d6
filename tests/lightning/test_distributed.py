"""The collectives of ``hieragent.lightning.distributed`` in a real 2-process gloo group,
checked against direct float64 sums of the same random inputs."""

import signal
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from ddp_probe import collectives_worker
from hieragent.lightning.distributed import all_sum, gather_objects, sum_gradients, world


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_in_one_process_every_collective_returns_its_input():
    assert world() == (0, 1)
    values = torch.randn(4, dtype=torch.float64)
    assert torch.equal(all_sum(values, "x"), values)
    obj = {"a": 1}
    assert gather_objects(obj, "x")[0] is obj
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3)
    before = p.grad.clone()
    sum_gradients([p])
    assert torch.equal(p.grad, before)


def test_two_ranks_sum_and_gather_and_a_lonely_collective_names_rank_and_stage(tmp_path):
    mp.start_processes(collectives_worker, args=(_free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    r = [torch.load(tmp_path / f"collectives{k}.pt", weights_only=False) for k in range(2)]
    direct = r[0]["values"].double() + r[1]["values"].double()
    for k in range(2):
        torch.testing.assert_close(r[k]["summed"], direct, rtol=1e-12, atol=0)
        assert r[k]["gathered"] == [{"rank": 0}, {"rank": 1}]
        # gradients: the sum over ranks, a missing one counted as zeros
        g0 = r[0]["local_grads"][0].double() + r[1]["local_grads"][0].double()
        torch.testing.assert_close(r[k]["grads"][0].double(), g0, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r[k]["grads"][1], r[0]["local_grads"][1], rtol=0, atol=0)
    assert torch.equal(r[0]["grads"][0], r[1]["grads"][0])  # the same bits on both ranks
    assert r[1]["local_grads"][1] is None
    error = r[0]["error"]
    assert error is not None and "rank 0 of 2" in error and "'the lonely stage'" in error


def _buffer(versions, dropped):
    return {"batches": [{"trajectories": [], "policy_version": v} for v in versions], "dropped_turns": dropped}


def test_replay_buffers_of_two_ranks_are_dealt_to_one_and_back():
    from hieragent.lightning.state import replay_share

    saved = [_buffer([0, 2], 5), _buffer([1, 2], 3)]  # two ranks' buffers
    one = replay_share(saved, rank=0, size=1)
    assert [b["policy_version"] for b in one["batches"]] == [0, 1, 2, 2]  # all of them, oldest first
    assert one["dropped_turns"] == 8
    assert replay_share(saved, rank=1, size=2) is saved[1]  # same number of ranks: its own
    three = [replay_share(saved, rank=r, size=3) for r in range(3)]
    assert sorted(b["policy_version"] for t in three for b in t["batches"]) == [0, 1, 2, 2]
    assert [len(t["batches"]) for t in three] == [2, 1, 1]
    assert sum(t["dropped_turns"] for t in three) == 8


@pytest.mark.parametrize("stopped,expected", [(False, 128 + signal.SIGTERM), (True, -signal.SIGTERM)])
def test_the_signal_watch_exits_at_once_and_hands_sigterm_back_when_stopped(stopped, expected):
    code = f"""
import os, signal, time
from hieragent.lightning.distributed import end_every_rank_on_signal
stop = end_every_rank_on_signal(lambda: [])
if {stopped}:
    stop()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == expected, done.stderr[-2000:]
