"""``hieragent export`` and ``hieragent play`` on a real tiny checkpoint, and a quiet CLI."""

import json

import pytest
import torch
from peft import PeftModel

from cli_helpers import make_workspace, run_cli as run
from hieragent.agent_command import play, play_pool
from hieragent.cli import check_checkpoint
from hieragent.envs.guards import LoopGuard
from hieragent.envs.pool import EnvPool
from hieragent.lightning.export import export_agent, module_from
from hieragent.models.loading import load_causal_lm

# third-party lines a plain `hieragent fit` used to print
NOISE = ("TPU available", "GPU available", "Tip:", "Seed set", "FutureWarning", "Loading weights",
         "stopped: `max_steps")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 2-step tiny fit, run as a user would (Python's warnings at their default)."""
    workdir = make_workspace(tmp_path_factory.mktemp("export"))
    fit = run(["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", "2"], workdir,
              env={"PYTHONWARNINGS": "default"})
    assert fit.returncode == 0, fit.stderr[-3000:]
    ckpt = workdir / "lightning_logs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    return workdir, ckpt, fit


@pytest.fixture(scope="module")
def ckpt(run_dir):
    """The fit's checkpoint with every LoRA B drawn at random. Two tiny steps can leave an
    adapter at its zero start (a group with equal returns has no advantage), and an export
    that dropped a zero adapter would pass unnoticed."""
    workdir, last, _ = run_dir
    state = torch.load(last, map_location="cpu", weights_only=False)
    g = torch.Generator().manual_seed(0)
    for key, value in state["state_dict"].items():
        if "lora_B" in key:
            state["state_dict"][key] = torch.randn(value.shape, generator=g) * 0.05
    path = last.parent / "perturbed.ckpt"
    torch.save(state, path)
    return path


@pytest.fixture(scope="module")
def exported(run_dir, ckpt):
    workdir = run_dir[0]
    out = run(["export", "--ckpt_path", str(ckpt), "--out", "agent"], workdir)
    assert out.returncode == 0, out.stderr[-3000:]
    return workdir / "agent"


def trainable(module):
    return {k: v.detach().clone() for k, v in module.trainable_parameters().items()}


def test_a_plain_fit_prints_no_third_party_noise_and_verbose_brings_it_back(run_dir, ckpt):
    workdir, _, fit = run_dir
    assert not [n for n in NOISE if n in fit.stderr + fit.stdout], fit.stderr[-3000:]
    verbose = run(["test", "--config", "configs/tiny.yaml", "--ckpt_path", str(ckpt),
                   "--data.eval_episodes", "1", "--data.eval_batch", "1"], workdir,
                  env={"HIERAGENT_DEBUG": "1"})
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert "TPU available" in verbose.stderr


def test_exported_adapters_load_with_peft_and_give_the_checkpoints_logprobs(ckpt, exported):
    assert sorted(p.name for p in exported.iterdir()) == [
        "README.md", "bank", "executor", "hieragent.json", "planner", "query_adapter.safetensors"]
    card = (exported / "README.md").read_text()
    assert "base model: `tiny`" in card and "2 optimizer steps" in card
    module = module_from(ckpt, "test")
    base = load_causal_lm("tiny", seed=0)
    peft = PeftModel.from_pretrained(base, exported / "executor", adapter_name="executor")
    peft.load_adapter(exported / "planner", adapter_name="planner")
    module.lm.eval(), peft.eval()
    ids = torch.randint(0, module.tokenizer.vocab_size, (3, 17), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        with module.lm.disable_adapter():
            plain = module.lm(ids).logits.log_softmax(-1)
        got = {}
        for role in ("planner", "executor"):
            module.lm.set_adapter(role)
            peft.set_adapter(role)
            ours = module.lm(ids).logits.log_softmax(-1)
            theirs = peft(ids).logits.log_softmax(-1)
            assert (ours - theirs).abs().max() <= 1e-6, role  # fp32, the same operations
            got[role] = theirs
    # the trained adapters move the log-probs: an export that lost them would fail above
    assert (got["planner"] - plain).abs().max() > 1e-5
    assert (got["executor"] - got["planner"]).abs().max() > 1e-5


def test_exported_folder_is_the_checkpoints_agent_as_init_from_and_in_hieragent_test(run_dir, ckpt, exported):
    workdir = run_dir[0]
    from_ckpt, from_dir = module_from(ckpt, "test"), module_from(exported, "test")
    a, b = trainable(from_ckpt), trainable(from_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fresh = trainable(module_from(ckpt, "test", init_from=None))
    assert any(not torch.equal(a[k], fresh[k]) for k in a)  # the weights did come from the files
    assert [from_dir.bank.entry(i) for i in from_dir.bank.ids()] == \
        [from_ckpt.bank.entry(i) for i in from_ckpt.bank.ids()]
    summaries = []
    for source in (str(ckpt), "agent"):
        test = run(["test", "--config", "configs/tiny.yaml", "--model.init_from", source], workdir)
        assert test.returncode == 0, test.stderr[-3000:]
        newest = max(workdir.glob("lightning_logs/tiny/version_*"), key=lambda p: int(p.name.split("_")[1]))
        summaries.append(json.loads((newest / "test_summary.json").read_text()))
    assert summaries[0] == summaries[1]


def test_play_prints_the_episode_that_test_would_play(run_dir, ckpt, exported, tmp_path):
    workdir = run_dir[0]
    out = run(["play", "--ckpt_path", "agent", "--seed", "1000002", "--json", str(tmp_path / "ep.json")], workdir)
    assert out.returncode == 0, out.stderr[-3000:]
    episode = json.loads((tmp_path / "ep.json").read_text())
    actions = [t for t in episode["turns"] if t["role"] == "executor"]
    plans = [t for t in episode["turns"] if t["role"] == "planner"]
    assert len(actions) == episode["length"] >= 1 and plans
    assert all(p["skills"] for p in plans)  # retrieval_k: 1 skill shown per subgoal
    lines = out.stdout.splitlines()
    assert lines[1] == f"mission: {episode['mission']}"
    assert sum(line.startswith("subgoal: ") for line in lines) == len(plans)
    for n, turn in enumerate(actions, 1):
        assert f"{n:3d}. {turn['action']}   reward {turn['reward']:+.3f}" in out.stdout
    assert lines[-1].startswith("success: " if episode["success"] else "failure: ")
    assert episode["return"] == pytest.approx(sum(t["reward"] for t in actions))
    # the same rollout code, unwatched, takes the same actions on that seed
    module = module_from(ckpt, "test")
    with EnvPool.make("BabyAI-GoToRedBallNoDists-v0", 1, max_steps=8) as pool:
        direct = module.collect(pool, [1000002], [0], greedy=True).trajectories[0]
    assert [t.text for t in direct.turns] == [t.get("subgoal", t.get("action")) for t in episode["turns"]]
    assert play(exported, "BabyAI-GoToRedBallNoDists-v0", 1000002)["turns"] == episode["turns"]


def test_play_builds_its_env_as_the_run_did(exported, tmp_path):
    """Episode cap, invalid-action penalty and loop guard come from the run's data settings
    (here an edited manifest), and its env options only reach its own env."""
    import shutil

    copy = tmp_path / "agent"
    shutil.copytree(exported, copy)
    manifest = json.loads((copy / "hieragent.json").read_text())
    manifest["data"].update(env="FrozenLake-4x4-v0", invalid_penalty=0.25, loop_guard=3, max_episode_steps=5,
                            env_options={"is_slippery": True})
    (copy / "hieragent.json").write_text(json.dumps(manifest))
    with play_pool(copy, "BabyAI-GoToRedBallNoDists-v0") as pool:  # not the run's env: no options
        env = pool.envs[0]
        assert isinstance(env, LoopGuard) and env.repeats == 3 and pool.invalid_penalty(0) == 0.25
        assert env.max_steps == 5
    with play_pool(copy, "FrozenLake-4x4-v0", max_steps=7) as pool:
        assert pool.envs[0].max_steps == 7 and pool.envs[0].env.is_slippery


def test_bad_input_fails_clearly_and_loses_nothing(run_dir, ckpt, exported, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="'.*notes' exists and is not an exported agent"):
        export_agent(ckpt, tmp_path / "notes")
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["keep.txt"]
    with pytest.raises(ValueError, match="BabyAI-Foo-v0"):
        play(ckpt, "BabyAI-Foo-v0", 1000000)
    with pytest.raises(ValueError, match=f"--model.init_from {exported}"):
        check_checkpoint(str(exported))  # `hieragent test --ckpt_path <folder>`
    out = run(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "notes")], run_dir[0])
    assert out.returncode == 2 and out.stderr.startswith("hieragent: error: --out")  # one line


def test_an_export_missing_an_adapter_is_refused_by_name(ckpt, tmp_path):
    out = export_agent(ckpt, tmp_path / "agent")
    for f in (out / "executor").iterdir():
        f.unlink()
    with pytest.raises(FileNotFoundError, match="executor"):
        module_from(out, "test")
