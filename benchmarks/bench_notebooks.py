"""Wall time of each notebook, run top to bottom from a fresh kernel (what a learner's Restart & Run All costs).

    .venv/bin/python benchmarks/bench_notebooks.py            # every notebook
    .venv/bin/python benchmarks/bench_notebooks.py 00 04      # the ones whose names start with these

Runs copies (the committed notebooks are not touched), prints seconds per notebook against the 60 s target, and
writes benchmarks/results/notebooks_<device>.json.
"""
import json
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from course_utils import get_device
from course_utils.timing import stamp

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 60


def run_notebook(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return time.perf_counter() - start


def main(prefixes):
    paths = [p for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
             if not prefixes or any(p.name.startswith(x) for x in prefixes)]
    results = {}
    for path in paths:
        seconds = run_notebook(path)
        results[path.stem] = round(seconds, 1)
        verdict = "ok" if seconds <= TARGET_S else f"over the {TARGET_S} s target"
        print(f"{path.stem:24s} {seconds:6.1f} s  ({verdict})", flush=True)
    device = get_device()
    out = ROOT / "benchmarks" / "results" / f"notebooks_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(out.read_text()).get("seconds", {}) if out.exists() else {}
    out.write_text(json.dumps({"stamp": stamp(device), "target_s": TARGET_S,
                               "seconds": {**previous, **results}}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1:])
