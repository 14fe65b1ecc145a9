"""The answer key: solved notebooks, every exercise blank replaced by its reference solution.

    python -m course_tools.solve notebooks/ solved/       # all notebooks
    python -m course_tools.solve notebooks/01_callables.ipynb solved/
    python -m course_tools.solve --list                   # every exercise of the course

Outputs are cleared in the solved copies (run them to see every check pass).
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import nbformat

from course_utils.exercises import load_all

CHECK_CALL = re.compile(r"""check\(\s*["'](\d\d\.\d+)["']""")


def exercise_cells(nb) -> list[tuple[int, str]]:
    """(cell index, exercise id) of each code cell that calls check("NN.k", ...)."""
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            for match in CHECK_CALL.finditer(cell.source):
                found.append((i, match.group(1)))
    return found


def solve_notebook(nb):
    """Return a solved copy of `nb` (a NotebookNode). Raises ValueError if a blank is not found once."""
    registry = load_all()
    nb = nbformat.reads(nbformat.writes(nb), as_version=4)  # a deep copy
    for i, ex_id in exercise_cells(nb):
        ex = registry.get(ex_id)
        if ex is None:
            raise ValueError(f"cell {i} checks exercise {ex_id}, which is not registered")
        source = nb.cells[i].source
        if source.count(ex.blank) != 1:
            raise ValueError(f"cell {i}: the blank of exercise {ex_id} appears {source.count(ex.blank)} times "
                             f"(expected once):\n{ex.blank}")
        nb.cells[i].source = source.replace(ex.blank, ex.solution)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return nb


def solve_paths(src: Path, out: Path) -> list[Path]:
    paths = sorted(src.glob("[0-9][0-9]_*.ipynb")) if src.is_dir() else [src]
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        if not exercise_cells(nb):
            continue
        target = out / path.name
        nbformat.write(solve_notebook(nb), target)
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_tools.solve",
                                     description="write solved copies of the notebooks (the answer key)")
    parser.add_argument("src", type=Path, nargs="?", help="a notebook or the notebooks/ folder")
    parser.add_argument("out", type=Path, nargs="?", help="folder for the solved notebooks")
    parser.add_argument("--list", action="store_true", help="list every exercise instead")
    args = parser.parse_args(argv)
    if args.list:
        for ex_id, ex in sorted(load_all().items()):
            print(f"{ex_id}  {ex.title}  ({len(ex.mistakes)} common mistakes, {len(ex.hints)} hints)")
        return 0
    if args.src is None or args.out is None:
        parser.error("give SRC (a notebook or the notebooks/ folder) and OUT (a folder), or --list")
    for path in solve_paths(args.src, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
