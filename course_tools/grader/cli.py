"""The grader's command line: `python -m course_tools.grade SUBMISSIONS/ --report report.html --csv report.csv`."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .limits import GiB, MiB, GradeError, Limits, parse_size
from .results import RANK, NotebookRun
from .run import grade
from .sandbox import Sandbox


def add_arguments(parser) -> None:
    def size(text):
        try:
            return parse_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    def positive(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
        return value

    parser.add_argument("submissions", type=Path,
                        help="folder with one notebook per learner (alice.ipynb) or one folder per learner")
    parser.add_argument("--report", type=Path, help="write the HTML report here")
    parser.add_argument("--csv", type=Path, help="write the table as CSV here (one row per learner and exercise)")
    parser.add_argument("--timeout", type=positive, default=300, help="seconds per notebook (default 300)")
    parser.add_argument("--memory", type=size, default=8 * GiB, help="address space per kernel (default 8G; 0: no "
                                                                     "limit)")
    parser.add_argument("--cpu", type=positive, default=None, help="CPU seconds per kernel (default 2 x timeout)")
    parser.add_argument("--output", type=size, default=10 * MiB, help="output per notebook (default 10M)")
    parser.add_argument("--file-size", type=size, default=256 * MiB, help="largest file a notebook may write "
                                                                          "(default 256M)")
    parser.add_argument("--disk", type=size, default=1 * GiB, help="size of the working directory's tmpfs where "
                                                                   "the sandbox has one (default 1G)")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks graded at the same time (default 1)")
    parser.add_argument("--processes", type=int, default=1024, help="processes and threads per kernel "
                                                                    "(RLIMIT_NPROC, default 1024)")
    parser.add_argument("--gpu", action="store_true", help="let the notebooks use the GPU (no memory limit then)")
    parser.add_argument("--unsafe-no-sandbox", action="store_true",
                        help="grade even where the kernels cannot be kept apart (no mount, network and PID "
                             "namespaces): only for a class whose code you trust")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_tools.grade",
                                     description="Grade a class: run each learner's notebook in a contained kernel "
                                                 "and check every exercise (HTML and CSV report).")
    add_arguments(parser)
    args = parser.parse_args(argv)
    # nbclient leaves its output-polling task pending when the grader stops a kernel: not worth a warning.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    for out in (args.report, args.csv):
        if out is not None and not out.parent.resolve().is_dir():
            print(f"grade: error: {out.parent} does not exist (needed for {out})", file=sys.stderr)
            return 2
    if args.jobs < 1:
        print(f"grade: error: --jobs must be at least 1, got {args.jobs}", file=sys.stderr)
        return 2

    def progress(run: NotebookRun) -> None:
        counts = {s: sum(o.status == s for o in run.outcomes.values()) for s in RANK}
        done = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        detail = f" ({run.detail})" if run.detail else ""
        print(f"{run.learner} / {run.name}: {run.status}{detail} in {run.counted:.1f} s ({run.seconds:.1f} s with "
              f"the kernel's start); {done or 'no exercises'}", flush=True)
        for alert in run.alerts:
            print(f"  WARNING: {alert}", flush=True)

    try:
        limits = Limits(timeout=args.timeout, memory=args.memory, cpu=args.cpu, output=args.output,
                        file_size=args.file_size, disk=args.disk, gpu=args.gpu, processes=args.processes)
        sandbox = Sandbox.probe()
        if not sandbox.complete and args.unsafe_no_sandbox:
            print(f"grade: WARNING: NO SANDBOX ({sandbox.why_not or 'only ' + ', '.join(sandbox.namespaces)}): "
                  "the notebooks can read and change each other's work, reach the network and stop the grader; "
                  "the results are only as trustworthy as the class", file=sys.stderr, flush=True)
        report = grade(args.submissions, limits, jobs=args.jobs, progress=progress,
                       unsafe_no_sandbox=args.unsafe_no_sandbox)
    except GradeError as exc:
        print(f"grade: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("grade: interrupted; no report written", file=sys.stderr)
        return 130
    for ok, what, detail in report.containment():
        if not ok:
            print(f"note: NOT applied: {what}: {detail}")
    for learner in report.learners:
        print(f"{learner}: {report.score(learner)}/{len(report.exercises)} correct")
    if args.report:
        report.write_html(args.report)
        print(f"wrote {args.report}")
    if args.csv:
        report.write_csv(args.csv)
        print(f"wrote {args.csv}")
    return 0
