"""Real multi-process fits: `hieragent fit --trainer.strategy ddp --trainer.devices 2` on CPU
(gloo, the tiny model), against one process playing the same episodes.

Each rank records what it held through ``ddp_probe.RankProbe`` (a callback given on the
command line). fp32 throughout: the two runs sum the same gradients in another order, so
parameters agree to rounding (tolerance 1e-5), while the two ranks agree bit for bit.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cli_helpers import make_workspace

HERE = Path(__file__).resolve().parent


def _env():
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}


def _args(out, processes, *flags):
    args = [sys.executable, "-m", "hieragent.cli", "fit", "--config", "configs/tiny.yaml",
            "--trainer.max_steps", "2", "--data.env", "BabyAI-GoToObjS4-v0", "--data.group_size", "4",
            "--model.score_reduction", "mean",
            "--trainer.callbacks+=ddp_probe.RankProbe", f"--trainer.callbacks.out={out}", *flags]
    if processes > 1:
        args += ["--trainer.strategy", "ddp", "--trainer.devices", str(processes)]
    return args


def fit(workspace, out, processes, *flags, timeout=600):
    done = subprocess.run(_args(out, processes, *flags), cwd=workspace, env=_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def ranks(out, processes):
    return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(processes)]


def last_checkpoint(workspace):
    found = sorted(Path(workspace).glob("lightning_logs/tiny/version_*/checkpoints/last.ckpt"))
    assert found, "no checkpoint written"
    return found[-1]


# an IVF index that retrains in a background thread at every 5% of growth: across processes its
# builds are swapped in at a vote of the ranks; two lists, all probed, search exactly. A thread
# (build_loan 0), not the default loans: these runs are 2-3 updates, too few loans to finish a
# build in; tests/memory/test_index.py votes on lent builds
INDEX = ("--model.memory.index.kind", "ivf_flat", "--model.memory.index.nlist", "2",
         "--model.memory.index.train_per_list", "2", "--model.memory.index.retrain_growth", "1.05",
         "--model.memory.index.background_from", "0", "--model.memory.index.build_loan", "0")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two ranks of one seed each against one process of two seeds: the same four episodes."""
    two = make_workspace(tmp_path_factory.mktemp("two_ranks"))
    one = make_workspace(tmp_path_factory.mktemp("one_process"))
    fit(two, two / "probe", 2, "--data.seeds_per_batch", "1", *INDEX)
    fit(one, one / "probe", 1, "--data.seeds_per_batch", "2", "--data.episode_seeding", "true", *INDEX)
    return two, one


def test_two_ranks_take_exactly_the_step_one_process_takes_on_the_same_episodes(runs):
    two, one = runs
    r0, r1 = ranks(two / "probe", 2)
    (single,) = ranks(one / "probe", 1)
    # the ranks played disjoint whole groups, which together are the one process's batch
    for step in range(2):
        s0, s1 = r0["batches"][step]["seeds"], r1["batches"][step]["seeds"]
        assert len(set(s0)) == 1 and len(set(s1)) == 1 and s0 != s1 and len(s0) == 4
        assert s0 + s1 == single["batches"][step]["seeds"]
        assert r0["batches"][step]["turns"] + r1["batches"][step]["turns"] == single["batches"][step]["turns"]
    assert r0["skips"] == r1["skips"] == single["skips"] == [None, None]
    # the first update's gradients: normalised by every rank's tokens and summed over ranks,
    # they are the one process's (Adam and clipping would hide a uniform error in scale)
    assert r0["grads"].keys() == single["grads"].keys() and len(r0["grads"]) > 0
    for name, g in r0["grads"].items():
        assert torch.equal(g, r1["grads"][name]), name
        # to rounding at the tensor's scale: elements near zero differ by more than 1e-5 of
        # themselves where the kernels sum in another order by batch shape (seen on an AMX Xeon:
        # 4.5e-8 on gradients of 0.08), while a wrong scale or a missing rank's share is far above it
        scale = single["grads"][name].abs().max().item()
        torch.testing.assert_close(g, single["grads"][name], rtol=1e-5, atol=1e-5 * scale, msg=name)
    init = torch.load(last_checkpoint(two), weights_only=False)["state_dict"]
    moved = 0.0
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name  # bit-identical across ranks
        torch.testing.assert_close(p, single["params"][name], rtol=0, atol=1e-5, msg=name)
        assert torch.equal(init[name], p)  # the checkpoint holds what rank 0 trained
        moved = max(moved, float((single["params"][name] - p).abs().max()))
    assert moved <= 1e-5
    # and training did move the adapters (lora_B starts at zero)
    assert max(float(p.abs().max()) for n, p in r0["params"].items() if "lora_B" in n) > 1e-4


def _same_bank(a, b, where="bank"):
    assert a.keys() == b.keys(), where
    for key in a:
        if isinstance(a[key], dict):
            _same_bank(a[key], b[key], f"{where}.{key}")
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), f"{where}.{key}"
        else:
            assert a[key] == b[key], f"{where}.{key}"


def test_every_rank_holds_the_same_bank_as_the_checkpoint_and_the_one_process_run(runs):
    two, one = runs
    r0, r1 = ranks(two / "probe", 2)
    (single,) = ranks(one / "probe", 1)
    _same_bank(r0["bank"], r1["bank"])  # the index too: kind, rows and FAISS bytes
    assert r0["bank"]["index_state"]["active"] == "ivf_flat"
    saved = torch.load(last_checkpoint(two), weights_only=False)["hieragent"]["bank"]
    _same_bank(r0["bank"], saved)
    for key in ("texts", "kinds", "uses", "utilities", "ids"):
        assert r0["bank"][key] == single["bank"][key] if key != "ids" else torch.equal(
            r0["bank"][key], single["bank"][key]), key
    torch.testing.assert_close(r0["bank"]["keys"], single["bank"]["keys"], rtol=0, atol=1e-6)
    # the change log is written once (rank 0), with the changes one process makes
    logs = [list(Path(w).glob("lightning_logs/tiny/version_*/bank_changes.jsonl")) for w in (two, one)]
    assert len(logs[0]) == len(logs[1]) == 1
    assert logs[0][0].read_text() == logs[1][0].read_text() != ""


def test_evaluation_is_the_mean_over_every_ranks_episodes(runs):
    two, one = runs
    r0, r1 = ranks(two / "probe", 2)
    (single,) = ranks(one / "probe", 1)
    assert r0["eval_seeds"] and r1["eval_seeds"] and not set(r0["eval_seeds"]) & set(r1["eval_seeds"])
    episodes = r0["eval_local"] + r1["eval_local"]
    assert sorted(r0["eval_seeds"] + r1["eval_seeds"]) == sorted(single["eval_seeds"])
    for r in (r0, r1):
        assert r["eval_summary"]["episodes"] == len(episodes) == 4
        assert r["eval_summary"]["success"] == pytest.approx(sum(episodes) / len(episodes))
    assert sorted(episodes) == sorted(single["eval_local"])
    assert r0["eval_summary"]["success"] == pytest.approx(single["eval_summary"]["success"])


def test_a_ddp_checkpoint_resumes_in_one_process_and_a_one_process_checkpoint_in_two(runs, tmp_path):
    two, one = runs
    for source, processes, seeds in ((two, 1, "2"), (one, 2, "1")):
        (tmp_path / f"resume_{processes}").mkdir()
        workspace = make_workspace(tmp_path / f"resume_{processes}")
        ckpt = last_checkpoint(source)
        fit(workspace, workspace / "probe", processes, "--data.seeds_per_batch", seeds, "--data.episode_seeding",
            "true", "--trainer.max_steps", "3", "--ckpt_path", str(ckpt))
        after = ranks(workspace / "probe", processes)
        before = torch.load(ckpt, weights_only=False)
        assert [b["step"] for b in after[0]["batches"]] == [2]  # resumed at step 2, one more step
        # the seeds go on where the checkpoint left them: 2 steps x 2 seeds were played
        assert sorted(s for r in after for s in set(r["batches"][0]["seeds"])) == [4, 5]
        resumed = torch.load(last_checkpoint(workspace), weights_only=False)
        assert resumed["global_step"] == 3 and before["global_step"] == 2
        for name, p in after[0]["params"].items():
            assert not torch.equal(p, before["state_dict"][name]) or "lora_A" in name
            if processes == 2:
                assert torch.equal(p, after[1]["params"][name])


def test_ranks_with_uneven_episodes_and_a_nan_on_one_rank_still_finish_together(tmp_path):
    workspace = make_workspace(tmp_path)
    # micro-batches of 2 turns: episodes of different lengths give the ranks different numbers
    fit(workspace, workspace / "probe", 2, "--data.seeds_per_batch", "1", "--trainer.max_steps", "3",
        "--model.objective.micro_batch_turns", "2", "--trainer.callbacks.poison_rank=1",
        "--trainer.callbacks.poison_step=1", "--data.max_episode_steps", "6")
    r0, r1 = ranks(workspace / "probe", 2)
    assert any(a["micro_batches"] != b["micro_batches"] for a, b in zip(r0["batches"], r1["batches"]))
    # the step of the NaN (rank 1's only) is skipped on both ranks, the others run on both
    assert r1["skips"][1].startswith("non-finite executor loss")
    assert r0["skips"][1] == "non-finite loss on another rank"
    # a skipped step is no step: step 1 runs again, on a fresh batch, then step 2
    assert len(r0["skips"]) == len(r1["skips"]) == 4
    assert r0["skips"][0] is r1["skips"][0] is None
    assert r0["skips"][2:] == r1["skips"][2:] == [None, None]
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name
    assert torch.load(last_checkpoint(workspace), weights_only=False)["global_step"] == 3


def test_ranks_whose_banks_part_stop_with_an_error_naming_the_step(tmp_path):
    workspace = make_workspace(tmp_path)
    done = subprocess.run(_args(workspace / "probe", 2, "--data.seeds_per_batch", "1", "--trainer.max_steps", "3",
                                "--trainer.callbacks.rogue_rank=1"),
                          cwd=workspace, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    # the entry came with step 1's rollout; the check follows that step's update
    assert "after optimizer step 2, rank 0's bank differ from rank 1's" in done.stderr, done.stderr[-3000:]
    assert "training stops here" in done.stderr


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of a child already gone counts as ended
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_ctrl_c_to_the_launcher_ends_every_rank(tmp_path, signum):
    workspace = make_workspace(tmp_path)
    out = workspace / "probe"
    proc = subprocess.Popen(_args(out, 2, "--data.seeds_per_batch", "1", "--trainer.max_steps", "1000"),
                            cwd=workspace, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.time() + 300
        while not (out / "rank1.pid").exists() or not list(workspace.glob("lightning_logs/tiny/*/checkpoints/*.ckpt")):
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.time() < deadline, "the ranks never started training"
            time.sleep(0.5)
        rank1 = int((out / "rank1.pid").read_text())
        proc.send_signal(signum)
        code = proc.wait(timeout=60)
        assert code == 128 + signum
        deadline = time.time() + 30
        while _alive(rank1) and time.time() < deadline:
            time.sleep(0.2)
        assert not _alive(rank1), "rank 1 outlived the launcher"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
