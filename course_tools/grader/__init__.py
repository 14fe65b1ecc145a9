"""Grade a class: run every learner's notebook in a contained, fresh kernel and check each exercise.

    python -m course_tools.grade SUBMISSIONS/ --report report.html --csv report.csv

SUBMISSIONS/ holds one notebook per learner (`alice.ipynb`: learner "alice") or one folder per learner
(`bob/01_callables.ipynb`, ...: learner "bob"). Each notebook maps to the exercises whose `check("NN.k", ...)`
calls it contains.

How a notebook is graded. It runs in its own kernel (nbclient), cell after cell, errors or not, like
"Restart kernel and run all" that does not stop at an error. Before the learner's first cell the grader runs
its own cell, which loads the course's checkers afresh under a private module name
(`course_utils._grader_<random>`, not the `course_utils.exercises` the notebook imports). After each exercise
cell the grader runs another cell of its own that calls that private checker on the learner's answer object
(the name the cell hands to `check`, looked up in the kernel's namespace) and prints the result framed by a
random token made for that one call; only that framed line counts. Outputs saved in the notebook are
ignored, and so is whatever the notebook's own `check` prints: redefining `check`, replacing the course's
checkers in `course_utils.exercises` or editing the saved outputs to show "[correct]" changes nothing (and is
flagged).

Containment (each item is reported as applied or not, with the reason, in the report):

* one kernel process per notebook, in an empty temporary working directory (also its HOME and TMPDIR), with
  a wall-clock time limit per notebook and a cap on the output it may send;
* POSIX resource limits in the kernel process: address space (RLIMIT_AS), CPU seconds (RLIMIT_CPU), size of
  any file written (RLIMIT_FSIZE), no core dumps;
* on Linux, where `unshare` may create namespaces (as root, or unprivileged user namespaces): no network (a
  new network namespace), its own PID namespace (it cannot see or signal the grader; when the kernel stops
  everything it started stops too), and a mount namespace in which the whole file system is read-only except
  the working directory (a size-capped tmpfs); the kernel runs without capabilities;
* everywhere, an audit hook (`sys.addaudithook`, which cannot be removed) installed in the kernel before the
  learner's code refuses Python-level writes, deletions and renames outside the working directory and
  signals to the kernel's parent; and after every notebook the grader checks that the submissions folder
  and its own working directory (unless that is a shared folder such as /tmp) are unchanged.

What it cannot prevent: the learner's code runs in the same process as the checker, so code written to
cheat on purpose can still win: it can find the grader's private checker through `sys.modules` or the
garbage collector and replace it, patch `torch` functions the checkers rely on, install IPython input
transformers that rewrite the grader's cells, or print a forged result once it has seen a token. The
grader flags the usual shortcuts (calling `solution()`, exec'ing a reference solution's text, pasting it
verbatim, redefining `check`, replacing the course's checkers) but does not prove their absence. Without
namespaces (macOS, Windows, Linux without permission to create them) there is no network isolation and
code that starts processes or uses ctypes escapes the audit hook; fork bombs and disk usage outside the
tmpfs are not limited (use a container or a cgroup for that).

The modules, each depending only on those after it: `cli` (the command line), `run` (`grade()`: the grading run
of each notebook), `submissions` (which files are the learners' notebooks, read safely: regular files only, no link
followed, no content in an error), `report` (`ClassReport`: the table, HTML and CSV, its cells escaped for
spreadsheets), `results` (`Outcome`, `NotebookRun`), `limits` (`Limits`, sizes, `GradeError`), `kernel` (the grader's own cells, run in the learner's kernel) and
`sandbox` (what the machine allows, and the launcher run between `unshare` and the kernel: standard library only).
"""
from .cli import add_arguments, main
from .limits import GiB, MiB, GradeError, Limits, format_size, parse_size
from .report import ClassReport
from .results import CORRECT, INCORRECT, NOT_ATTEMPTED, NOT_RUN, NotebookRun, Outcome
from .run import grade
from .sandbox import Sandbox
from .submissions import find_submissions, read_notebook

__all__ = ["grade", "find_submissions", "read_notebook", "Limits", "GradeError", "parse_size", "format_size", "GiB", "MiB",
           "ClassReport", "NotebookRun", "Outcome", "Sandbox", "CORRECT", "INCORRECT", "NOT_ATTEMPTED", "NOT_RUN",
           "add_arguments", "main"]
