"""Every notebook in notebooks/ runs top to bottom (nbclient); a failing cell fails the test.

The notebooks use small sizes so that each runs in well under a minute on 2 CPU cores.
Each runs in a fresh kernel of the interpreter running pytest, with notebooks/ as the
working directory; nothing is written back to the .ipynb files.

To keep the suite fast, the kernels compile with XLA's backend optimisation level 0
(compilation dominates at these sizes), except the scaling notebook, whose live timings
should be those of optimised code.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
FAST_COMPILE = "--xla_backend_optimization_level=0"
OPTIMISED = {"03_scaling"}          # notebooks that time code: no compile shortcut


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path: Path, monkeypatch):
    # The kernel spec runs "python": make it this interpreter (the one with jax_dilated).
    bindir = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", bindir + os.pathsep + os.environ.get("PATH", ""))
    if path.stem not in OPTIMISED:
        flags = os.environ.get("XLA_FLAGS", "")
        monkeypatch.setenv("XLA_FLAGS", f"{flags} {FAST_COMPILE}".strip())
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}})
    start = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name}: a cell failed:\n{e}", pytrace=False)
    print(f"{path.name}: {time.perf_counter() - start:.1f} s")


def test_notebooks_are_saved_light():
    """Keep the repository light: notebooks are committed (nearly) without outputs."""
    assert PATHS, "no notebooks found"
    for path in PATHS:
        assert path.stat().st_size < 200_000, f"{path.name} is {path.stat().st_size} bytes"
