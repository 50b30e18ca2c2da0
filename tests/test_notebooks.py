"""The notebooks run top to bottom (each checks its numbers against the seeds or the committed
results and fails if one drifts), and are committed without outputs: a fresh run is the only
record of what they show."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_the_four_notebooks_are_there():
    assert [p.name[:3] for p in NOTEBOOKS] == ["01-", "02-", "03-", "04-"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    book = nbformat.read(path, as_version=4)
    for cell in book.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: strip outputs before committing"
            assert cell.execution_count is None, path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_top_to_bottom(path):
    book = nbformat.read(path, as_version=4)
    client = NotebookClient(
        book, timeout=600, kernel_name="python3", resources={"metadata": {"path": path.parent}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, when a check fails
