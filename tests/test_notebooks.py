"""Every notebook executes top to bottom against a real (short) training run, or the
results notebook against a real ``--quick`` reproduction."""

import nbformat
import pytest
from nbclient import NotebookClient

from cli_helpers import REPO, held, make_workspace, run_cli

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    work = make_workspace(tmp_path_factory.mktemp("nb"))
    fit = run_cli(["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", "3"], work)
    assert fit.returncode == 0, fit.stderr[-3000:]
    return work, work / "lightning_logs" / "tiny" / "version_0"


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no .ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, finished_run, repro_quick, offpolicy_quick, monkeypatch):
    work, run = finished_run
    monkeypatch.setenv("HIERAGENT_RUN", str(run))
    monkeypatch.setenv("HIERAGENT_REPRO", str(repro_quick[1]))  # results.ipynb reads a repro's folder
    monkeypatch.setenv("HIERAGENT_REPRO_OFFPOLICY", str(offpolicy_quick[1]))  # and the off-policy one
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    with held(repro_quick[1]):  # not while a test on another worker reruns it
        NotebookClient(nb, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(work)}}).execute()
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) >= (4 if path.name == "results.ipynb" else 3), f"{path.name} drew {len(images)} figures"
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []))
    # it read the run it was pointed at
    assert str(repro_quick[1] if path.name == "results.ipynb" else run) in text
    if path.name == "results.ipynb":
        assert str(offpolicy_quick[1]) in text and "stale, turn IS" in text
