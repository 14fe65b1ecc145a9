"""Grading a class: the wall time of grading N copies of the solved notebook 01 with --jobs 1 and --jobs 2, beside
the time of running the same notebook once in a plain kernel (what the grader adds: the sandbox, the kernel's
start, its own cells and checks).

    .venv/bin/python benchmarks/bench_grader.py            # a class of 30
    .venv/bin/python benchmarks/bench_grader.py --class 6  # quicker

Prints seconds per notebook for each --jobs, the jobs-2 speed-up, and graded / plain per notebook; every copy must
grade "correct" on every exercise (else the figures mean nothing and it stops). Writes
benchmarks/results/grader_<device>.json. Run it on a quiet machine: it measures wall time.
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from course_tools import grader
from course_tools.solve import solve_notebook
from course_utils.timing import stamp

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "01_callables.ipynb"


def plain_seconds(solved, work: Path, repeats: int = 3) -> float:
    """Median wall time of running the solved notebook top to bottom in a fresh plain kernel (no grader)."""
    times = []
    for _ in range(repeats):
        nb = nbformat.from_dict(json.loads(json.dumps(solved)))
        start = time.perf_counter()
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(work)}}).execute()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def grade_class(solved, size: int, jobs: int, work: Path) -> float:
    subs = work / f"class_{jobs}"
    subs.mkdir()
    for i in range(size):
        nbformat.write(solved, subs / f"learner{i:02d}.ipynb")
    sandbox = grader.Sandbox.probe()
    start = time.perf_counter()
    report = grader.grade(subs, grader.Limits(timeout=300), jobs=jobs, unsafe_no_sandbox=not sandbox.complete)
    seconds = time.perf_counter() - start
    wrong = [(learner, ex_id, o.status) for learner, row in report.table.items() for ex_id, o in row.items()
             if o.status != grader.CORRECT]
    if wrong or len(report.table) != size or not report.exercises:
        sys.exit(f"not every copy graded correct: {wrong[:3]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--class", dest="size", type=int, default=30, help="copies of the notebook (default 30)")
    args = parser.parse_args()
    solved = solve_notebook(nbformat.read(NOTEBOOK, as_version=4))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        plain = plain_seconds(solved, work)
        graded = {jobs: grade_class(solved, args.size, jobs, work) for jobs in (1, 2)}
    per = {jobs: s / args.size for jobs, s in graded.items()}
    print(f"notebook 01 (solved), a class of {args.size}; sandbox: "
          f"{', '.join(grader.Sandbox.probe().namespaces) or 'none'}")
    print(f"  plain kernel, one run:  {plain:6.1f} s")
    for jobs, s in graded.items():
        print(f"  graded, --jobs {jobs}:      {s:6.1f} s for the class, {per[jobs]:5.1f} s a notebook "
              f"(x{per[jobs] / plain:.2f} a plain run)")
    print(f"  --jobs 2 speed-up: x{graded[1] / graded[2]:.2f}")
    out = ROOT / "benchmarks" / "results" / "grader_cpu.json"
    out.write_text(json.dumps({"stamp": stamp(), "class_size": args.size, "plain_s": round(plain, 2),
                               "graded_s": {str(j): round(s, 1) for j, s in graded.items()},
                               "per_notebook_s": {str(j): round(s, 2) for j, s in per.items()},
                               "jobs2_speedup": round(graded[1] / graded[2], 2)}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
