"""``make repro-babyai --quick`` and ``make repro-games --quick``: every row from its jobs'
files, the env-step budget, the learning curve, resuming, and refusals (real subprocess
runs of the tiny model)."""

import csv
import json
import random
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone

import numpy as np
import pytest

from cli_helpers import held
from hieragent.repro import recipe
from hieragent.repro.runner import Job, Plan, mean_std, run_plan

LEVEL = "BabyAI-GoToRedBallNoDists-v0"
ROWS = ["BabyAI bot",
        "untrained, flat (executor only)", "warm start, flat (executor only)",
        "warm start + RL, flat (executor only)",
        "untrained, hierarchical + trained, evolving bank", "warm start, hierarchical + trained, evolving bank",
        "warm start + RL, hierarchical + trained, evolving bank"]


def read_json(path):
    return json.loads(path.read_text())


def rerun(work, out, *extra):
    return subprocess.run([sys.executable, "-m", "hieragent.repro.babyai", "--quick", "--out", str(out),
                           "--levels", LEVEL, *extra], cwd=work, capture_output=True, text=True, timeout=600)


def test_every_row_comes_from_its_jobs_files(repro_quick):
    _, out, done = repro_quick
    results = read_json(out / "results.json")
    rows = {r["row"]: r for r in results["rows"]}
    assert list(rows) == ROWS and all(r["table"] == LEVEL for r in rows.values())
    short = "GoToRedBallNoDists"
    run = lambda job: out / short / job / "run" / "version_0"  # noqa: E731
    bot = read_json(out / short / "expert" / "result.json")
    assert rows["BabyAI bot"]["per_seed"]["0"] == {k: bot[k] for k in ("success", "length", "return", "episodes")}
    for variant, label in (("flat", ROWS[1].split(", ")[1]), ("hier", ROWS[4].split(", ", 1)[1])):
        sft = read_json(run(f"sft_{variant}") / "eval_summary.json")
        assert rows[f"untrained, {label}"]["success"] == [sft["before"]["success"], 0.0]
        assert rows[f"warm start, {label}"]["per_seed"]["0"]["success"] == sft["after"]["success"]
        rl = read_json(run(f"rl_{variant}/seed0") / "eval_summary.json")
        got = rows[f"warm start + RL, {label}"]["per_seed"]["0"]
        assert got["success"] == rl["after"]["success"] and got["env_steps"] == rl["env_steps"]
        # the curve starts at the warm start's result, then each validation, then the end
        assert got["curve"][0] == {"env_steps": 0, "success": sft["after"]["success"],
                                   "return": sft["after"]["return"], "length": sft["after"]["length"]}
        assert got["curve"][-1]["env_steps"] == rl["env_steps"]
    assert "| warm start + RL, flat (executor only) | 1 |" in (out / "results.md").read_text()
    assert "| BabyAI bot | 1 | 1.000 | — |" in done.stdout


def test_rl_stops_at_the_env_step_budget_and_records_its_curve(repro_quick):
    _, out, _ = repro_quick
    budget, every = recipe.QUICK["env_steps"], recipe.QUICK["val_every"]
    run = out / "GoToRedBallNoDists" / "rl_hier" / "seed0" / "run" / "version_0"
    with open(run / "metrics.csv", newline="") as f:
        steps = [float(r["train/env_steps"]) for r in csv.DictReader(f) if r.get("train/env_steps")]
    assert steps[-1] >= budget > steps[-2]  # the step that crossed the budget was the last
    assert read_json(run / "eval_summary.json")["env_steps"] == steps[-1]
    points = [json.loads(line) for line in (run / "curve.jsonl").read_text().splitlines()]
    assert points and all(p["step"] % every == 0 and 0 < p["env_steps"] <= steps[-1] for p in points)
    assert all(0.0 <= p["success"] <= 1.0 for p in points)


def test_conditions_name_the_date_machine_precision_and_wall_time(repro_quick):
    _, out, _ = repro_quick
    c = read_json(out / "results.json")["conditions"]
    assert c["date"] == datetime.now(timezone.utc).strftime("%Y-%m-%d")
    assert c["precision"] == "32-true"  # what the quick jobs ran in, read from their configs
    assert c["machine"] and c["cpu_cores"] >= 1
    assert len(c["job_wall_time_s"]) == 6 and c["wall_time_s"] == pytest.approx(sum(c["job_wall_time_s"].values()), abs=0.5)


def test_mean_std_is_the_sample_statistics():
    values = [random.Random(3).uniform(-2, 5) for _ in range(7)]
    mean, std = mean_std(values)
    assert mean == pytest.approx(float(np.mean(np.float64(values))), abs=1e-12)
    assert std == pytest.approx(float(np.std(np.float64(values), ddof=1)), abs=1e-12)
    assert mean_std([0.25]) == (0.25, 0.0)


def test_a_rerun_skips_finished_jobs_and_resumes_an_unfinished_fit(repro_quick):
    work, out, _ = repro_quick
    job = out / "GoToRedBallNoDists" / "rl_flat" / "seed0"
    with held(out):
        before = read_json(out / "results.json")
        (job / "run" / "version_0" / "eval_summary.json").unlink()  # as if killed before the end
        logs = {p: p.read_text() for p in out.glob("**/job.log")}
        again = rerun(work, out)
    assert again.returncode == 0, again.stderr[-3000:]
    changed = [p for p in logs if p.read_text() != logs[p]]
    assert changed == [job / "job.log"]  # the five finished jobs did not run again
    resumed = (job / "job.log").read_text().splitlines()
    assert sum(line.startswith("$ python -m hieragent.cli fit") for line in resumed) == 2
    assert "--ckpt_path" in [line for line in resumed if line.startswith("$ ")][-1]
    after = read_json(out / "results.json")
    assert [r["row"] for r in after["rows"]] == [r["row"] for r in before["rows"]]


def test_a_job_run_with_another_command_is_refused_by_name(repro_quick, tmp_path):
    work, out, _ = repro_quick
    saved = out / "GoToRedBallNoDists" / "sft_hier" / "command.json"
    original = saved.read_text()
    record = json.loads(original)
    record["argv"] = [*record["argv"], "--trainer.max_steps", "99"]
    with held(out):
        saved.write_text(json.dumps(record))
        try:
            refused = rerun(work, out)
        finally:
            saved.write_text(original)
    assert refused.returncode != 0
    assert "job 'GoToRedBallNoDists/sft_hier'" in refused.stderr and "another command" in refused.stderr


def test_a_failing_job_stops_the_plan_and_names_its_log(tmp_path):
    bad = Job("L/bot", ["hieragent.repro.expert", "--env", "BabyAI-NoSuchLevel-v0", "--episodes", "2",
                        "--out", str(tmp_path / "L" / "bot" / "result.json")], "result.json")
    later = Job("L/later", ["hieragent.repro.expert", "--env", LEVEL, "--episodes", "1",
                            "--out", str(tmp_path / "L" / "later" / "result.json")], "result.json")
    with pytest.raises(RuntimeError, match=r"job 'L/bot' failed .*/L/bot/job\.log") as err:
        run_plan(Plan("t", [bad, later], []), tmp_path)
    assert "BabyAI-NoSuchLevel-v0" in str(err.value)  # the log's tail is in the message
    assert not (tmp_path / "L" / "later").exists()


def test_runners_on_other_jobs_of_one_folder_keep_each_others_timings(tmp_path):
    job = Job("L/bot", ["hieragent.repro.expert", "--env", LEVEL, "--episodes", "1",
                        "--out", str(tmp_path / "L" / "bot" / "result.json")], "result.json")
    ran = threading.Thread(target=run_plan, args=(Plan("t", [job], []), tmp_path))
    ran.start()
    log = tmp_path / "L" / "bot" / "job.log"
    while not log.exists() and ran.is_alive():
        time.sleep(0.01)
    # another runner (``--only`` another job) finishes its job while this one's runs
    (tmp_path / "timings.json").write_text(json.dumps({"L/other": 7.0}))
    ran.join()
    timings = read_json(tmp_path / "timings.json")
    assert timings["L/other"] == 7.0 and timings["L/bot"] > 0


def test_games_quick_runs_the_recipe_on_frozenlake(tmp_path):
    from cli_helpers import make_workspace

    work = make_workspace(tmp_path)
    done = subprocess.run([sys.executable, "-m", "hieragent.repro.games", "--quick", "--out", "games"],
                          cwd=work, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = read_json(work / "games" / "results.json")["rows"]
    assert [r["row"] for r in rows] == [
        "expert (value iteration)", "untrained, hierarchical + trained, evolving bank",
        "warm start, hierarchical + trained, evolving bank", "warm start + RL, hierarchical + trained, evolving bank"]
    assert rows[0]["success"] == [1.0, 0.0] and rows[0]["table"] == "FrozenLake-4x4-v0"
    assert all(r["success"] is not None for r in rows)
