"""Wall time of each notebook, run top to bottom from a fresh kernel (what a learner's Restart & Run All costs),
on a quiet machine and beside one other CPU-bound process (a learner's laptop is never idle).

    .venv/bin/python benchmarks/bench_notebooks.py            # every notebook, quiet and busy
    .venv/bin/python benchmarks/bench_notebooks.py 00 04      # the ones whose names start with these
    .venv/bin/python benchmarks/bench_notebooks.py --quiet    # quiet only (half the time)

Runs copies (the committed notebooks are not touched) and prints, per notebook, the quiet and busy seconds and
their ratio against the targets (quiet <= 60 s; busy <= 90 s and <= 1.5x quiet), and the slowest cells beside the
busy process (target: none over 20 s). Writes benchmarks/results/notebooks_<device>.json.
"""
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from course_utils import get_device
from course_utils.timing import stamp

ROOT = Path(__file__).resolve().parents[1]
QUIET_S, BUSY_S, BUSY_RATIO, CELL_S = 60, 90, 1.5, 20
BUSY_LOOP = "while True:\n    pass\n"  # one core's worth of someone else's work: a browser tab, another kernel


def _seconds(cell) -> float | None:
    timing = cell.get("metadata", {}).get("execution", {})
    try:
        start = datetime.datetime.fromisoformat(timing["iopub.execute_input"].replace("Z", "+00:00"))
        end = datetime.datetime.fromisoformat(timing["shell.execute_reply"].replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return None
    return (end - start).total_seconds()


def run_notebook(path: Path) -> tuple[float, dict[int, float]]:
    """Seconds for the whole notebook, and per code cell (by its position among the code cells, from 1)."""
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=900, kernel_name="python3", record_timing=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    total = time.perf_counter() - start
    code = [c for c in nb.cells if c.cell_type == "code"]
    return total, {i: s for i, c in enumerate(code, 1) if (s := _seconds(c)) is not None}


def run_busy(path: Path) -> tuple[float, dict[int, float]]:
    """The same, with one CPU-bound process running beside the kernel for the whole notebook."""
    busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    try:
        return run_notebook(path)
    finally:
        busy.kill()
        busy.wait()


def main(args):
    quiet_only = "--quiet" in args
    prefixes = [a for a in args if not a.startswith("--")]
    paths = [p for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
             if not prefixes or any(p.name.startswith(x) for x in prefixes)]
    results, busy_results, slow_cells = {}, {}, {}
    for path in paths:
        quiet, _cells = run_notebook(path)
        results[path.stem] = round(quiet, 1)
        line = f"{path.stem:24s} quiet {quiet:6.1f} s" + ("" if quiet <= QUIET_S else f" (over {QUIET_S} s)")
        if not quiet_only:
            busy, cells = run_busy(path)
            busy_results[path.stem] = round(busy, 1)
            ok = busy <= BUSY_S and busy <= BUSY_RATIO * quiet
            line += f"   busy {busy:6.1f} s  x{busy / quiet:4.2f}" + ("" if ok else "  (over target)")
            slow = {i: round(s, 1) for i, s in sorted(cells.items(), key=lambda kv: -kv[1])[:3] if s > 5}
            slow_cells[path.stem] = slow
            if slow:
                line += "   slowest cells busy: " + ", ".join(
                    f"#{i} {s:.1f} s" + ("!" if s > CELL_S else "") for i, s in slow.items())
        print(line, flush=True)
    device = get_device()
    out = ROOT / "benchmarks" / "results" / f"notebooks_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(out.read_text()) if out.exists() else {}
    out.write_text(json.dumps({
        "stamp": stamp(device),
        "targets": {"quiet_s": QUIET_S, "busy_s": BUSY_S, "busy_ratio": BUSY_RATIO, "cell_s": CELL_S},
        "seconds": {**old.get("seconds", {}), **results},
        "busy_seconds": {**old.get("busy_seconds", {}), **busy_results},
        "busy_slowest_cells": {**old.get("busy_slowest_cells", {}), **slow_cells},
    }, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1:])
