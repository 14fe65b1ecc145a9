"""Run each notebook with every exercise filled in with its reference solution: every check must pass.

This is the instructor's version (`python -m course_tools.solve notebooks/ OUT`), executed from a
fresh kernel like a learner's restart-and-run-all. It runs once, in the Chinese edition
(`translate.solved_notebook`: the English solved notebook translated by the same catalogs). The code is the same
in both editions (tests/test_translation.py proves it token by token) and only the words differ, so this one run
proves the solutions in their notebooks and the Chinese feedback at once; every solution's English feedback is
proven in tests/test_exercises.py, and the English notebooks run under nbval."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from course_tools import translate
from course_tools.solve import exercise_cells

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
WITH_EXERCISES = [p for p in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
                  if exercise_cells(nbformat.read(p, as_version=4))]


@pytest.mark.slow
@pytest.mark.parametrize("path", WITH_EXERCISES, ids=[p.stem for p in WITH_EXERCISES])
def test_solved_notebook_passes_every_check(path, tmp_path):
    solved = translate.solved_notebook(path)
    # up to the last exercise: the cells after it are those of the learner's notebook, which nbval runs (both editions)
    solved.cells = solved.cells[:max(i for i, _ in exercise_cells(solved)) + 1]
    # its own folder: the files a notebook writes (checkpoints, traces) must not meet those of its nbval run
    NotebookClient(solved, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    for i, ex_id in exercise_cells(solved):
        text = "".join(o.get("text", "") for o in solved.cells[i].outputs if o.get("output_type") == "stream")
        assert f"练习 {ex_id} [正确]" in text, f"cell {i} ({ex_id}) printed: {text!r}"
