"""Reproduction runs: a list of jobs (CLI commands), resumable, summarised over seeds.

A ``make repro-*`` target is a plan: jobs, each one ``hieragent`` or ``python -m`` command
run in a subprocess with its own folder under ``--out``. A job is done when its result file
exists, so running the target again after an interruption skips the finished jobs and
resumes a half-done ``fit`` from its ``last.ckpt``. Each job's output goes to ``job.log`` in
its folder; the console shows one progress bar over the jobs.

When every job is done, ``results.json`` holds each row's per-seed values (and learning
curves), the summary rows (mean ± sample std over seeds), and the conditions: date,
machine, precision, torch threads and the wall time of each job. ``results.md`` is the
table as the README shows it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from fnmatch import fnmatch
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hieragent.io import atomic_write_text

METRICS = ("success", "return", "length")


@dataclass(frozen=True)
class Column:
    """A column of a results table, over a row's seeds.

    ``kind``: ``mean`` (mean ± sample std of a number), ``count`` (in how many seeds a flag
    is true, of how many) or ``seeds`` (each seed's value of ``key``, in seed order).
    Numbers are shown with ``digits`` decimals.
    """

    key: str
    header: str
    kind: str = "mean"
    digits: int = 3


COLUMNS = (Column("success", "success"), Column("return", "return"), Column("length", "length"))


@dataclass
class Job:
    """One command of a reproduction.

    Attributes:
        name: The job's folder under the output folder, e.g. ``GoToLocal/rl_flat/seed1``.
        argv: The command after ``python -m``: ``["hieragent.cli", "fit", ...]``.
        result: The file, relative to the job's folder, whose presence means done.
        resume: For a ``fit``: resume from the job's ``last.ckpt`` if one exists.
    """

    name: str
    argv: list[str]
    result: str
    resume: bool = False


@dataclass
class Row:
    """A row of a results table: its jobs' results for each seed, read by ``read``.

    ``read(folder)`` returns ``{"success", "return", "length", ...}`` of one seed's job
    (``curve``: a list of points, optional).
    """

    table: str
    name: str
    jobs: dict[int, str]  # seed -> job name
    read: Callable[[Path], dict[str, Any]]
    note: str = ""


@dataclass
class Plan:
    title: str
    jobs: list[Job]
    rows: list[Row]
    settings: dict[str, Any] = field(default_factory=dict)
    columns: tuple[Column, ...] = COLUMNS


def log_dir(folder: Path) -> Path:
    """Where a job's ``hieragent`` run writes (``logger_args`` below)."""
    return folder / "run" / "version_0"


def logger_args(folder: Path) -> list[str]:
    """A fixed log folder per job, so that a rerun finds the job's checkpoint and results."""
    return ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
            "--trainer.logger.save_dir", str(folder), "--trainer.logger.name", "run",
            "--trainer.logger.version", "0"]


def run_plan(plan: Plan, out: Path, console: Console | None = None, only: str | None = None) -> dict[str, Any]:
    """Run the jobs not yet done (those matching the glob ``only``, if given), then
    summarise what is done; returns what ``results.json`` holds."""
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    check_commands(plan, out)
    chosen = [j for j in plan.jobs if only is None or fnmatch(j.name, only)]
    todo = [j for j in chosen if not done(j, out)]
    if len(todo) < len(chosen):
        console.print(f"{len(chosen) - len(todo)} of {len(chosen)} jobs already done in {out}")
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task(plan.title, total=len(chosen), completed=len(chosen) - len(todo))
        for job in todo:
            progress.update(bar, description=f"{plan.title}: {job.name}")
            add_time(out, job.name, _run(job, out / job.name))
            progress.advance(bar)
    timings = _read_timings(out)
    names = {j.name for j in plan.jobs}  # a job renamed since keeps its time in timings.json only
    results = summarise(plan, out, {k: v for k, v in timings.items() if k in names})
    results["conditions"]["precision"] = precisions(out, plan.jobs)
    atomic_write_text(out / "results.json", json.dumps(results, indent=1))
    atomic_write_text(out / "results.md", markdown(results))
    console.print(markdown(results), markup=False, highlight=False, soft_wrap=True)
    return results


def done(job: Job, out: Path) -> bool:
    return (out / job.name / job.result).is_file()


def check_commands(plan: Plan, out: Path) -> None:
    """A finished job counts only for the command that made it: a plan whose settings have
    changed since would mix two setups in one table, so it is refused, naming the job."""
    for job in plan.jobs:
        saved = out / job.name / "command.json"
        if done(job, out) and saved.is_file() and json.loads(saved.read_text(encoding="utf-8")) != record(job):
            raise ValueError(f"job '{job.name}' in {out} was run with another command (see its job.log); "
                             "give another --out, or remove that job's folder to run it again")


def record(job: Job) -> dict[str, Any]:
    """What a job's result depends on: its command, and the content of its config file."""
    configs = [Path(v) for k, v in zip(job.argv, job.argv[1:]) if k == "--config"]
    return {"argv": job.argv, "configs": {str(c): hashlib.sha256(c.read_bytes()).hexdigest()
                                          for c in configs if c.is_file()}}


def add_time(out: Path, name: str, seconds: float) -> None:
    """Add a job's wall time to ``timings.json``, read afresh: another runner working on
    other jobs of the same folder (``--only``) may have written it since this one started."""
    timings = _read_timings(out)
    timings[name] = timings.get(name, 0.0) + seconds
    atomic_write_text(out / "timings.json", json.dumps(timings, indent=1))


def _read_timings(out: Path) -> dict[str, float]:
    try:
        return json.loads((out / "timings.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _run(job: Job, folder: Path) -> float:
    folder.mkdir(parents=True, exist_ok=True)
    argv = list(job.argv)
    last = log_dir(folder) / "checkpoints" / "last.ckpt"
    if job.resume and last.is_file():
        argv += ["--ckpt_path", str(last)]
    start = time.perf_counter()
    with open(folder / "job.log", "a", encoding="utf-8") as log:
        log.write(f"$ python -m {' '.join(argv)}\n")
        log.flush()
        finished = subprocess.run([sys.executable, "-m", *argv], stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "COLUMNS": "120"})
    seconds = time.perf_counter() - start
    if finished.returncode != 0 or not (folder / job.result).is_file():
        tail = (folder / "job.log").read_text(encoding="utf-8", errors="replace")[-2000:]
        raise RuntimeError(f"repro job '{job.name}' failed (exit {finished.returncode}); its log is "
                           f"{folder / 'job.log'}; it ends with:\n{tail}")
    atomic_write_text(folder / "command.json", json.dumps(record(job)))
    return seconds


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1); the deviation of one value is 0."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(plan: Plan, out: Path, timings: dict[str, float]) -> dict[str, Any]:
    rows = []
    for row in plan.rows:
        finished = {j.name for j in plan.jobs if done(j, out)}
        per_seed = {seed: row.read(out / job) for seed, job in row.jobs.items() if job in finished}
        summary: dict[str, Any] = {"table": row.table, "row": row.name, "seeds": sorted(per_seed),
                                   "per_seed": {str(s): v for s, v in per_seed.items()}, "note": row.note}
        for column in plan.columns:
            values = [v[column.key] for v in per_seed.values() if v.get(column.key) is not None]
            if column.kind == "mean":
                summary[column.key] = list(mean_std(values)) if values else None
            elif column.kind == "count":
                summary[column.key] = [sum(bool(v) for v in values), len(values)] if values else None
        rows.append(summary)
    columns = [asdict(c) for c in plan.columns]
    return {"title": plan.title, "conditions": conditions(timings), "settings": plan.settings,
            "columns": columns, "rows": rows}


def conditions(timings: dict[str, float]) -> dict[str, Any]:
    """Date, machine, precision and wall time: what a reader needs to judge a figure."""
    import torch

    from hieragent.precision import machine_precision

    precision, reason = machine_precision("cpu" if not torch.cuda.is_available() else "auto")
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "machine": machine(),
            "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "machine_precision": f"{precision} ({reason})",
            "wall_time_s": round(sum(timings.values()), 1),
            "job_wall_time_s": {k: round(v, 1) for k, v in timings.items()}}


def precisions(out: Path, jobs: list[Job]) -> str:
    """The ``trainer.precision`` the jobs ran in (from each run's saved ``config.yaml``)."""
    import yaml

    found = set()
    for job in jobs:
        config = log_dir(out / job.name) / "config.yaml"
        if config.is_file():
            found.add(str(yaml.safe_load(config.read_text(encoding="utf-8"))["trainer"]["precision"]))
    return ", ".join(sorted(found)) or "none (no hieragent run)"


def machine() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def markdown(results: dict[str, Any]) -> str:
    """Each table of ``results`` as markdown: mean ± std over seeds, and the seed count."""
    c = results["conditions"]
    lines = [f"{results['title']}: {c['date']}, {c['machine']}, {c['cpu_cores']} cores, "
             f"{c['precision']}, {c['wall_time_s'] / 60:.0f} min of jobs", ""]
    tables: dict[str, list[dict[str, Any]]] = {}
    for row in results["rows"]:
        tables.setdefault(row["table"], []).append(row)
    columns = [Column(**c) for c in results.get("columns", [])] or list(COLUMNS)
    for table, rows in tables.items():
        lines += [f"**{table}**", "", "| row | seeds | " + " | ".join(c.header for c in columns) + " |",
                  "|---|---:|" + "---:|" * len(columns)]
        for row in rows:
            cells = [_cell(row, c) for c in columns]
            lines.append(f"| {row['row']} | {len(row['seeds'])} | {' | '.join(cells)} |")
        lines.append("")
    return "\n".join(lines)


def _cell(row: dict[str, Any], column: Column) -> str:
    n = len(row["seeds"])
    if column.kind == "seeds":
        values = [v.get(column.key) for v in row["per_seed"].values()]
        return " ".join("—" if v is None else f"{v:.{column.digits}f}" for v in values) if n else "not run"
    value = row.get(column.key)
    if value is None:
        return "not run" if n == 0 else "—"
    if column.kind == "count":
        return f"{value[0]}/{value[1]}"
    mean, std, d = *value, column.digits
    return f"{mean:.{d}f} ± {std:.{d}f}" if n > 1 else f"{mean:.{d}f}"


def eval_after(folder: Path, start: Path | None = None) -> dict[str, Any]:
    """A ``fit`` job's held-out result after training, its learning curve (held-out success
    against training env steps: before, each validation, after) and its env steps. A run
    that skipped its own "before" evaluation starts its curve at the result of the job
    ``start`` it was initialised from."""
    run = log_dir(folder)
    summary = json.loads((run / "eval_summary.json").read_text(encoding="utf-8"))
    before = summary.get("before") or (eval_after(start) if start is not None else None)
    curve = [{"env_steps": 0, **_point(before)}] if before else []
    if (run / "curve.jsonl").is_file():
        curve += [json.loads(line) for line in (run / "curve.jsonl").read_text().splitlines() if line]
    curve.append({"env_steps": summary.get("env_steps"), **_point(summary["after"])})
    return {**_point(summary["after"]), "env_steps": summary.get("env_steps"),
            "updates": summary.get("updates"), "curve": curve}


def eval_before(folder: Path) -> dict[str, Any]:
    """A ``fit`` job's held-out result before training."""
    summary = json.loads((log_dir(folder) / "eval_summary.json").read_text(encoding="utf-8"))
    return _point(summary["before"])


def _point(row: dict[str, Any]) -> dict[str, Any]:
    return {m: row.get(m) for m in METRICS}

