"""The Trainer's per-step overhead in executed instructions: a figure that a noisy machine cannot blur.

bench_peers.py times the Trainer against a hand-written loop; on a small shared VM the same step measured twice can
differ by 5-10 %, more than the 3 % it is meant to resolve. This benchmark counts instead: each contender trains
one epoch of 1000 steps under valgrind's callgrind, which counts every machine instruction the process executes
(Python interpreter, PyTorch's dispatcher and kernels alike). Two runs per contender, one with a single warm-up
epoch and one with an extra timed epoch; their difference divided by 1000 is the instructions one step costs,
start-up and import cancelled out, and the costs of each epoch's start and end spread over its steps. Same model, data, optimizer (SGD with momentum) and thread count (1) as
bench_peers.py's overhead-bound models:
  linear  nn.Linear(32 -> 10), batch 8
  bn      Linear 32->64, BatchNorm1d, ReLU, Linear 64->10, batch 8 (buffers: what oom_recovery saves each step)
Contenders: hand (the loop PyTorch's tutorials write, with the epoch's loss summed on the device in one fused op,
the usual way to avoid a sync per step; the Trainer keeps each batch's loss instead and adds them at the end), course
(`Trainer(...)(1)`), course_oom (`oom_recovery=True`). Targets (issue 21): course / hand <= 1.03 and
course_oom / course <= 1.03.

Instructions are a proxy for time, not time: a cache miss or a stall costs many cycles and counts one. For a
Python-bound loop that touches a few kilobytes they track time closely; bench_peers.py remains the time figure.

    .venv/bin/python benchmarks/bench_overhead.py           # 6-12 minutes on 2 cores; needs valgrind
    .venv/bin/python benchmarks/bench_overhead.py --worker linear course 1    # one run, without valgrind
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 1000
CONTENDERS = ("hand", "course", "course_oom")
MODELS = ("linear", "bn")


def worker(model_name: str, contender: str, extra_epochs: int) -> None:
    """Build the contender (bench_peers.py's own `Hand` and `Course`, the same loops it times), train one warm-up
    epoch, then `extra_epochs` more: the run valgrind counts."""
    import torch
    from torch import nn

    from bench_peers import Course, Hand  # its optional peers (Lightning, accelerate) load at import: cancelled out
    from course_utils.data import TensorLoader

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = torch.randn(8 * STEPS, 32), torch.randint(0, 10, (8 * STEPS,))
    if model_name == "linear":
        model = nn.Linear(32, 10)
    else:
        model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))
    loader = TensorLoader(x, y, batch_size=8, shuffle=False)
    run = Hand(model, loader) if contender == "hand" else Course(model, loader, oom_recovery=contender == "course_oom")
    for _ in range(1 + extra_epochs):
        run.run()


def count(model_name: str, contender: str, extra_epochs: int) -> int:
    """Instructions the whole worker process executed, as callgrind counts them."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        run = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                              sys.executable, __file__, "--worker", model_name, contender, str(extra_epochs)],
                             capture_output=True, text=True, cwd=ROOT, timeout=1800,
                             env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0"))
        found = re.search(r"I\s+refs:\s+([\d,]+)", run.stderr)
        if run.returncode != 0 or not found:
            raise RuntimeError(f"valgrind run {model_name}/{contender} failed:\n{run.stderr[-2000:]}")
        return int(found.group(1).replace(",", ""))


def main(jobs: int) -> None:
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt install valgrind): nothing to count")
        return
    runs = [(m, c, k) for m in MODELS for c in CONTENDERS for k in (0, 1)]
    with ThreadPoolExecutor(jobs) as pool:  # each run is one single-threaded process
        counts = dict(zip(runs, pool.map(lambda r: count(*r), runs)))
    results = {}
    for m in MODELS:
        per_step = {c: (counts[(m, c, 1)] - counts[(m, c, 0)]) / STEPS for c in CONTENDERS}
        results[m] = {"instructions_per_step": per_step,
                      "course_over_hand": per_step["course"] / per_step["hand"],
                      "oom_over_course": per_step["course_oom"] / per_step["course"]}
        print(f"{m}: instructions per step " + ", ".join(f"{c} {v:,.0f}" for c, v in per_step.items()))
        print(f"    course / hand {results[m]['course_over_hand']:.3f} (target <= 1.03), "
              f"course_oom / course {results[m]['oom_over_course']:.3f} (target <= 1.03)")
    sys.path.insert(0, str(ROOT))
    from course_utils.timing import stamp

    out = ROOT / "benchmarks" / "results" / "overhead_instructions.json"
    out.write_text(json.dumps({"stamp": stamp(), "steps": STEPS, "models": results}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--worker", nargs=3, metavar=("MODEL", "CONTENDER", "EXTRA_EPOCHS"))
    p.add_argument("--jobs", type=int, default=2, help="valgrind runs at a time (one core each)")
    a = p.parse_args()
    if a.worker:
        sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
        worker(a.worker[0], a.worker[1], int(a.worker[2]))
    else:
        main(a.jobs)
