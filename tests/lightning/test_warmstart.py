"""Supervised warm start: the imitation loss is the expert choice's NLL, a real SFT run
raises success, and RL starts from its checkpoint with ``model.init_from``."""

import copy
import csv
import json
import math

import pytest
import torch

from acting_helpers import prompt_ids
from cli_helpers import run_cli, run_cli_here
from hieragent.agents.policy import Executor, Planner
from hieragent.lightning.warmstart import _turn
from hieragent.rollout.demos import demonstrations, write_demonstrations

LEVEL = "BabyAI-GoToObjS4-v0"


def direct_nll(lm, prompt, candidates, chosen, temperature, reduction):
    """-log softmax over candidates of their (summed or mean) token log-probs, in float64,
    one unpadded forward per candidate."""
    scores = []
    for cand in candidates:
        ids = torch.tensor([prompt + cand])
        with torch.no_grad():
            logp = torch.log_softmax(lm(input_ids=ids).logits[0].double(), -1)  # [T, V]
        tok = torch.stack([logp[len(prompt) - 1 + j, c] for j, c in enumerate(cand)])
        scores.append(tok.sum() if reduction == "sum" else tok.mean())
    return float(-torch.log_softmax(torch.stack(scores) / temperature, 0)[chosen])


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_score_mode_imitation_nll_matches_a_direct_float64_computation(tiny_lm, tokenizer, reduction):
    policy = Executor(mode="score", temperature=0.7, score_reduction=reduction)
    policy.bind(tiny_lm, tokenizer)
    lm64 = copy.deepcopy(tiny_lm).double()
    lm64.set_adapter("executor")
    g = torch.Generator().manual_seed(1)
    words = ["turn left", "turn right", "go forward", "pick up", "drop", "toggle"]
    for trial in range(4):
        prompt = prompt_ids(policy, f"Subgoal: trial {trial}\nYou see {torch.rand(1, generator=g).item():.3f}.")
        cands = [words[i] for i in torch.randperm(6, generator=g)[: 2 + trial].tolist()]
        target = cands[int(torch.randint(len(cands), (1,), generator=g))]
        turn = _turn(policy, prompt, cands, target)
        got = -float(policy.turn_logprobs([turn])[0].detach().sum())
        want = direct_nll(lm64, prompt, turn.candidate_ids, turn.chosen, 0.7, reduction)
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-5), (got, want)


def test_an_expert_subgoal_missing_from_the_candidates_is_appended(tiny_lm, tokenizer):
    planner = Planner(mode="score")
    planner.bind(tiny_lm, tokenizer)
    turn = _turn(planner, prompt_ids(planner, "Mission: x"), ["explore", "go to the red ball"], "open the red door")
    assert len(turn.candidate_ids) == 3 and turn.chosen == 2
    assert turn.action_ids == planner.candidate_ids("open the red door")


def test_generate_mode_turn_is_the_expert_tokens_and_end_of_turn(tiny_lm, tokenizer):
    policy = Executor(mode="generate")
    policy.bind(tiny_lm, tokenizer)
    turn = _turn(policy, prompt_ids(policy, "Subgoal: x"), ["go forward"], "go forward")
    assert turn.action_ids == tokenizer.encode("go forward", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert len(turn.old_logprobs) == len(turn.action_ids) and turn.chosen == -1


def _rows(path, key):
    with open(path, newline="") as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key)]


def test_warm_start_raises_success_and_rl_starts_from_its_checkpoint(workspace):
    demos = workspace / "demos.jsonl"
    assert write_demonstrations(demonstrations(LEVEL, range(64)), demos) == 64
    small = ["--data.eval_episodes", "32", "--data.eval_batch", "32"]
    sft = run_cli(["fit", "--config", "configs/tiny_sft.yaml", "--data.demos", str(demos),
                   "--trainer.max_steps", "12", *small], workspace)
    assert sft.returncode == 0, sft.stderr[-3000:]
    run = workspace / "lightning_logs/tiny_sft/version_0"
    summary = json.loads((run / "eval_summary.json").read_text())
    assert summary["before"]["success"] <= 0.35  # the random tiny model, near chance
    assert summary["after"]["success"] >= 0.6
    nll = _rows(run / "metrics.csv", "sft/executor_nll")
    assert len(nll) == 12 and sum(nll[-3:]) < 0.5 * sum(nll[:3])
    tokens, turns = _rows(run / "metrics.csv", "sft/executor_tokens"), _rows(run / "metrics.csv", "sft/executor_turns")
    assert len(tokens) == 12 and all(40 <= a / b <= 400 for a, b in zip(tokens, turns))  # a prompt and its candidates

    ckpt = run / "checkpoints/last.ckpt"
    rl = run_cli(["fit", "--config", "configs/tiny_learn.yaml", "--model.init_from", str(ckpt),
                  "--trainer.max_steps", "1", *small], workspace)
    assert rl.returncode == 0, rl.stderr[-3000:]
    rl_summary = json.loads(next(workspace.glob("lightning_logs/tiny_learn/version_*/eval_summary.json"))
                            .read_text())
    # same held-out seeds, same sampling seed: the RL run starts exactly where SFT ended
    assert rl_summary["before"] == summary["after"]


def test_init_from_a_missing_checkpoint_is_a_one_line_error(workspace, monkeypatch, capsys):
    out = run_cli_here(["fit", "--config", "configs/tiny.yaml", "--model.init_from", "nope.ckpt",
                        "--trainer.max_steps", "1"], workspace, monkeypatch, capsys)
    assert out.returncode == 2
    assert "model.init_from" in out.stderr and "nope.ckpt" in out.stderr
    assert "Traceback" not in out.stderr
