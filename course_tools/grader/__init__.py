"""Grade a class: run every learner's notebook in a contained, fresh kernel and check each exercise.

    python -m course_tools.grade SUBMISSIONS/ --report report.html --csv report.csv

SUBMISSIONS/ holds one notebook per learner (`alice.ipynb`: learner "alice") or one folder per learner
(`bob/01_callables.ipynb`, ...: learner "bob"). Each notebook maps to the exercises whose `check("NN.k", ...)`
calls it contains.

How a notebook is graded. It runs in its own kernel (nbclient), cell after cell, errors or not, like
"Restart kernel and run all" that does not stop at an error. Before the learner's first cell the grader runs
its own cell, which loads the course's checkers afresh under a private module name
(`course_utils._grader_<random>`, not the `course_utils.exercises` the notebook imports) and registers a comm
target. After each exercise cell the grader sends a comm message (IPython runs no event hook and no input
transformer for one): the kernel resets the IPython hooks and transformers the notebook installed (flagged), calls
the private checker on the learner's answer object (the name the cell hands to `check`, looked up in the kernel's
namespace) and prints the result framed by a random token made for that one call; only that framed line counts.
Outputs saved in the notebook are ignored, and so is whatever the notebook's own `check` prints. Every cell after
the setup, the grader's checks included, counts against the time limit. Tampering the grader notices is flagged on
every exercise of the notebook, with what it means for the result; a changed private checker gives "not run".

Containment (each item is reported as applied or not, with the reason, in the report): one kernel per notebook in
an empty working directory, a wall-clock time limit, an output cap, RLIMIT_AS / CPU / FSIZE / NPROC, and, where
`unshare` may create mount, network and PID namespaces: no network, its own PID namespace (and IPC namespace where
`unshare --ipc` works: no SysV or POSIX IPC object outlives it), a private /tmp,
/var/tmp and /dev/shm (one capped tmpfs holding the working directory), the submissions, the grader's folders and
/run hidden, the rest read-only, no capabilities, and (as root) a uid of its own. Without those namespaces the
grader refuses unless `unsafe_no_sandbox` (`--unsafe-no-sandbox`). Everywhere an audit hook refuses Python-level
writes by path outside the working directory and /dev (not writes through a file descriptor such as os.fchmod(fd),
not sqlite3.connect or socket.bind: without the read-only mounts plain Python can still write those ways), and the
submissions and the grader's folder are checked after each notebook. The kernel's ipc folder (connection file,
sockets, log) is on the host's /tmp: each file capped by RLIMIT_FSIZE, the folder not counted in --disk; the grader
reads its files there only as plain files (O_NOFOLLOW), and treats kernel messages of the wrong shape as the
notebook's "malformed output". The time limit is per notebook: a folder of N notebooks gets N x --timeout.
Names that collide once cleaned are all graded ("alice", "alice (2)"), with a note; the reports replace text UTF-8
cannot encode.

What it cannot prevent (the threat model is a learner who writes Python, not a kernel exploit): the learner's code
runs in the same process as the checker, so code written to cheat on purpose can still forge a result unnoticed:
replace the grader's objects or the json encoder, patch `torch` functions the checkers rely on, rewrite the
checker's locals with sys.settrace, or read the token and print a framed line of its own. INSTRUCTORS.md lists what
is prevented, detected and not.

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
