"""Grade a class: run every learner's notebook in a contained, fresh kernel and check each exercise.

    python -m course_utils.exercises grade SUBMISSIONS/ --report report.html --csv report.csv

SUBMISSIONS/ holds one notebook per learner (`alice.ipynb`: learner "alice") or one folder per learner
(`bob/01_callables.ipynb`, ...: learner "bob"). Each notebook maps to the exercises whose `check("NN.k", ...)`
calls it contains.

How a notebook is graded. It runs in its own kernel (nbclient), cell after cell, errors or not, like
"Restart kernel and run all" that does not stop at an error. Before the learner's first cell the grader runs
its own cell, which loads the course's checkers afresh under a private module name
(`course_utils._grader_<random>`, not the `course_utils.exercises` the notebook imports). After each exercise
cell the grader runs another cell of its own that calls that private checker on the learner's answer object
(the name the cell hands to `check`, looked up in the kernel's namespace) and prints the result framed by a
random token made for that one call; only that framed line counts. Outputs saved in the notebook are ignored, and so is whatever the notebook's own `check`
prints: redefining `check`, replacing the course's checkers in `course_utils.exercises` or editing the saved
outputs to show "[correct]" changes nothing (and is flagged).

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
"""
from __future__ import annotations

# Only the standard library at module level: this file is also the sandbox launcher, run as a script
# (`python -I -S grade.py --sandbox CONFIG -- KERNEL...`) between `unshare` and the kernel.
import json
import os
import signal
import sys
import time

GiB, MiB = 2 ** 30, 2 ** 20
CORRECT, INCORRECT, NOT_ATTEMPTED, NOT_RUN = "correct", "incorrect", "not attempted", "not run"
_RANK = {CORRECT: 0, INCORRECT: 1, NOT_ATTEMPTED: 2, NOT_RUN: 3}
_MAX_NOTEBOOK = 100 * 2 ** 20  # bytes of .ipynb the grader reads
_LINUX = sys.platform.startswith("linux")


# ============================================================================================================
# The launcher: runs inside the new namespaces (as their PID 1), sets the limits up and starts the kernel.
# ============================================================================================================

def _sandbox_main(argv: list[str]) -> int:
    """`grade.py --sandbox CONFIG -- KERNEL_CMD...`: apply what the config asks, fork the kernel, wait for it."""
    config_path, cmd = argv[0], argv[2:]
    with open(config_path) as f:
        config = json.load(f)
    applied, missing = [], []
    if config.get("protect_fs"):
        try:
            left = _protect_filesystem(config["work"], config["ipc"], config.get("disk"))
            applied.append("filesystem")
            if left:
                missing.append(["filesystem (partly)", "left writable: " + ", ".join(left)])
        except Exception as exc:  # reported; the audit hook still guards Python-level writes
            missing.append(["filesystem", str(exc)])
    if not config.get("protect_fs") or "filesystem" not in applied:
        os.makedirs(config["work"], exist_ok=True)
    os.makedirs(os.path.join(config["work"], "tmp"), exist_ok=True)
    for name, value in config.get("rlimits", {}).items():
        try:
            import resource
            limit = getattr(resource, "RLIMIT_" + name)
            soft, hard = resource.getrlimit(limit)
            if hard != resource.RLIM_INFINITY and value > hard:
                value = hard
            resource.setrlimit(limit, (value, value))
            applied.append("RLIMIT_" + name)
        except Exception as exc:
            missing.append(["RLIMIT_" + name, f"{type(exc).__name__}: {exc}"])
    caps = os.name == "posix" and os.geteuid() == 0
    with open(config["status"], "w") as f:
        json.dump({"applied": applied, "missing": missing, "pid1": os.getpid() == 1, "caps_dropped": caps}, f)
    pid = os.fork()
    if pid == 0:  # the kernel
        try:
            os.chdir(config["work"])
            log = os.open(config["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            if caps:
                _drop_capabilities()
            os.execve(cmd[0], cmd, config["env"])
        except BaseException:
            import traceback
            traceback.print_exc()
        os._exit(127)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # interrupts are for the kernel, not for its supervisor
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))
    lock = os.open(config["lock"], os.O_RDONLY)
    last_check = time.monotonic()
    while True:
        try:
            done, status = os.waitpid(-1, os.WNOHANG)  # as PID 1, also reap what the kernel left behind
        except ChildProcessError:
            return 0
        if done == pid:
            code = os.waitstatus_to_exitcode(status)
            return 128 - code if code < 0 else code
        if done == 0:
            time.sleep(0.1)
            if time.monotonic() - last_check > 1:
                last_check = time.monotonic()
                if _grader_is_gone(lock):
                    os.kill(pid, signal.SIGKILL)


def _grader_is_gone(fd: int) -> bool:
    """The grader holds an exclusive lock on the lock file while it needs the kernel; it is gone if we get it."""
    import fcntl
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _protect_filesystem(work: str, ipc: str, disk: int | None) -> list[str]:
    """In a new mount namespace: everything read-only except `ipc` (bind) and `work` (a tmpfs of `disk` bytes).

    Returns the mount points that could not be made read-only (the root one raises)."""
    import subprocess

    def mount(*args: str) -> None:
        run = subprocess.run(["mount", *args], capture_output=True, text=True)
        if run.returncode:
            raise OSError(f"mount {' '.join(args)}: {run.stderr.strip() or run.returncode}")

    mount("--make-rprivate", "/")
    mount("--bind", ipc, ipc)
    os.makedirs(work, exist_ok=True)
    if disk:
        mount("-t", "tmpfs", "-o", f"size={int(disk)},mode=0700", "tmpfs", work)
    else:
        mount("--bind", work, work)
    keep = {os.path.realpath(work), os.path.realpath(ipc)}
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].encode().decode("unicode_escape") for line in f]
    left = []
    for point in dict.fromkeys(points):
        if point in keep or point.split("/")[1] in ("proc", "sys", "dev"):
            continue
        try:
            mount("-o", "remount,bind,ro", point)
        except OSError:
            if point == "/":
                raise
            left.append(point)  # the audit hook still guards it
    return left


def _drop_capabilities() -> None:
    """Empty the capability bounding set and forbid gaining privileges: root in the namespace becomes powerless."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 24, 38
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--sandbox":
    sys.exit(_sandbox_main(sys.argv[2:]))


# ============================================================================================================
# Code the grader runs in the kernel (its own cells, never the learner's).
# ============================================================================================================

_KERNEL_SETUP = r'''
def __course_grader_setup(private, exercises_dir, course_dir, workdir, solutions, token, grader_pid):
    import functools, importlib.util, json, os, sys, tempfile
    shell = get_ipython()
    spec = importlib.util.spec_from_file_location(private, os.path.join(exercises_dir, "__init__.py"),
                                                  submodule_search_locations=[exercises_dir])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[private] = pkg
    spec.loader.exec_module(pkg)
    registry = pkg.load_all()
    evaluate = pkg.evaluate
    import course_utils.exercises as public
    import course_utils.exercises.core as public_core
    public.load_all()  # the notebook's own check() then costs the learner's time budget no imports
    out, dumps, realpath, isabs, join, readlink, getcwd = (sys.stdout, json.dumps, os.path.realpath,
                                                            os.path.isabs, os.path.join, os.readlink, os.getcwd)
    calls, executed = set(), set()
    original_solution, original_check, original_evaluate = public_core.solution, public.check, public_core.evaluate

    @functools.wraps(original_solution)
    def solution(exercise_id):
        calls.add(str(exercise_id))
        return original_solution(exercise_id)

    public.solution = public_core.solution = solution
    try:
        from ipykernel.compiler import get_tmp_directory
        cell_prefixes = (get_tmp_directory() + os.sep, "<ipython-input-")
    except Exception:
        cell_prefixes = (join(tempfile.gettempdir(), "ipykernel_"), "<ipython-input-")
    allowed = (realpath(workdir), "/dev")
    protected_pids = {os.getppid(), grader_pid, -1} - {0, 1}
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    path_events = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.chown": (0,),
                   "os.truncate": (0,), "os.utime": (0,), "os.rename": (0, 1), "os.link": (1,), "os.symlink": (1,),
                   "os.mkfifo": (0,), "os.mknod": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
                   "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.copytree": (1,), "shutil.move": (0, 1)}

    def outside(path, dir_fd=None):
        if isinstance(path, int):
            return False
        path = os.fsdecode(os.fspath(path))
        if not isabs(path):
            path = join(readlink(f"/proc/self/fd/{dir_fd}") if isinstance(dir_fd, int) else getcwd(), path)
        path = realpath(path)
        return not any(path == root or path.startswith(root + os.sep) for root in allowed)

    def guard(event, args):
        refused = None
        try:
            if event == "open":
                path, mode, flags = args
                if ((isinstance(mode, str) and any(c in mode for c in "wax+"))
                        or (mode is None and isinstance(flags, int) and flags & writes)) and outside(path):
                    refused = path
            elif event in path_events:
                dir_fd = args[-1] if event in ("os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.utime",
                                               "os.symlink", "os.mkfifo", "os.mknod", "os.chown") else None
                for i in path_events[event]:
                    if outside(args[i], dir_fd):
                        refused = args[i]
                        break
            elif event in ("os.kill", "os.killpg"):
                if args[0] in protected_pids:
                    refused = f"process {args[0]}"
            elif event == "compile":
                source, filename = args
                if isinstance(source, bytes):
                    source = source.decode("utf-8", "replace")
                name = str(filename)
                if (isinstance(source, str) and name != "<>" and not name.startswith(cell_prefixes)
                        and not name.startswith(course_dir)):  # "<>": IPython's own look at a cell
                    for ex_id, text in solutions.items():
                        if text in source:
                            executed.add(ex_id)
        except Exception:
            return
        if refused is not None:
            raise PermissionError(f"the grader does not let a notebook change {refused} ({event}): only its "
                                  "working directory is writable")

    sys.addaudithook(guard)

    class Grader:
        def evaluate(self, exercise_id, answer_name, token):
            ns = shell.user_ns
            try:
                if answer_name in ns:
                    result = evaluate(exercise_id, ns[answer_name])
                    status, message = result.status, result.message
                else:
                    status, message = "not attempted", (f"`{answer_name}` is not defined: the exercise's cell did "
                                                        "not define it")
            except BaseException as exc:
                status, message = "incorrect", f"checking the answer raised {type(exc).__name__}: {exc}"
            flags = []
            if exercise_id in calls:
                flags.append(f"called solution({exercise_id!r})")
            if exercise_id in executed:
                flags.append("ran the reference solution's text through exec/compile")
            tamper = []
            if "check" in ns and ns["check"] is not original_check:
                tamper.append("redefines check() (ignored: the grader checks with its own copy of the checkers)")
            if public.check is not original_check or public_core.evaluate is not original_evaluate:
                tamper.append("replaced course_utils.exercises.check or evaluate (ignored)")
            if sys.modules.get("course_utils.exercises") is not public:
                tamper.append("replaced the module course_utils.exercises in sys.modules (ignored)")
            mine, theirs = registry.get(exercise_id), public_core.REGISTRY.get(exercise_id)
            if theirs is not None and mine is not None and getattr(theirs.checker, "__code__", None) != mine.checker.__code__:
                tamper.append(f"replaced the checker of {exercise_id} in course_utils.exercises (ignored)")
            out.write(token + " " + dumps({"token": token, "id": exercise_id, "status": status, "message": message,
                                           "flags": flags, "tamper": tamper}) + "\n")
            out.flush()

    pkg.__grader__ = Grader()
    out.write(token + " " + dumps({"token": token, "ready": True}) + "\n")
    out.flush()

__course_grader_setup(**__import__("json").loads(%(args)r))
del __course_grader_setup
'''

_KERNEL_EVAL = '__import__("sys").modules[%(private)r].__grader__.evaluate(%(id)r, %(answer)r, %(token)r)\n'


# ============================================================================================================
# The grader.
# ============================================================================================================

class GradeError(Exception):
    """Bad input (no such folder, no notebooks, unwritable report...): a message for the user, no traceback."""


class _SetupFailed(Exception):
    """The grader's own first cell failed in the kernel (a limit too tight for importing torch, ...)."""


def parse_size(text: str) -> int:
    """'8G', '512M', '100k', '8GiB', '1.5G' or a number of bytes -> bytes."""
    import re
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(text))
    if not match:
        raise ValueError(f"expected a size such as 8G, 512M or 100000 (bytes), got {text!r}")
    scale = {"": 1, "k": 2 ** 10, "m": MiB, "g": GiB, "t": 2 ** 40}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


def format_size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


class Limits:
    """What one notebook may use. `cpu` defaults to twice the time limit (the kernel's threads add up)."""

    def __init__(self, timeout: float = 300, memory: int | None = 8 * GiB, cpu: int | None = None,
                 output: int = 10 * MiB, file_size: int = 256 * MiB, disk: int = 1 * GiB, gpu: bool = False):
        if timeout <= 0:
            raise GradeError(f"the time limit must be positive, got {timeout}")
        self.timeout, self.memory, self.output, self.file_size, self.disk, self.gpu = (
            float(timeout), memory, int(output), int(file_size), int(disk), gpu)
        self.cpu = int(cpu) if cpu else int(max(10, 2 * timeout))
        if self.gpu:
            self.memory = None  # CUDA reserves far more address space than any useful RLIMIT_AS


class Sandbox:
    """What this machine allows: found once per grading run by trying `unshare`."""

    def __init__(self, prefix: list[str], namespaces: list[str], why_not: str):
        self.prefix, self.namespaces, self.why_not = prefix, namespaces, why_not

    @property
    def mounts(self) -> bool:
        return "mount" in self.namespaces

    @classmethod
    def probe(cls) -> "Sandbox":
        import shutil
        import subprocess
        if not _LINUX:
            return cls([], [], f"namespaces are Linux-only (this is {sys.platform})")
        unshare = shutil.which("unshare")
        if not unshare:
            return cls([], [], "the `unshare` command (util-linux) was not found")
        user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        tries = [(["--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"], ["mount", "net", "pid"]),
                 (["--net", "--pid", "--fork", "--kill-child", "--mount-proc"], ["net", "pid"]),
                 (["--net"], ["net"])]
        errors = []
        for flags, kinds in tries:
            if "mount" in kinds and not shutil.which("mount"):
                continue
            try:
                run = subprocess.run([unshare, *user, *flags, "true"], capture_output=True, text=True, timeout=20)
            except (OSError, subprocess.SubprocessError) as exc:
                errors.append(str(exc))
                continue
            if run.returncode == 0:
                why = "" if "mount" in kinds else ("; ".join(dict.fromkeys(errors)) or "`mount` not found")
                return cls([unshare, *user, *flags], kinds, why)
            errors.append(run.stderr.strip() or f"exit status {run.returncode}")
        return cls([], [], "; ".join(dict.fromkeys(errors)))


class Outcome:
    def __init__(self, status: str, message: str, notebook: str = "", flags: list[str] | None = None):
        self.status, self.message, self.notebook, self.flags = status, message, notebook, list(flags or [])


class NotebookRun:
    """One notebook's grading: how the run ended, the outcome of each exercise it checks, notes."""

    def __init__(self, learner: str, path, name: str):
        self.learner, self.path, self.name = learner, path, name
        self.status, self.detail, self.seconds = "completed", "", 0.0
        self.outcomes: dict[str, Outcome] = {}
        self.notes: list[str] = []
        self.alerts: list[str] = []    # tampering with files outside the working directory
        self.sandbox: dict = {}


def find_submissions(root) -> dict[str, list]:
    """{learner: [notebook paths]}: a notebook per learner (name = file stem) or a folder per learner."""
    from pathlib import Path
    root = Path(root)
    if not root.exists():
        raise GradeError(f"{root}: no such folder")
    if not root.is_dir():
        raise GradeError(f"{root} is a file; give the folder that holds the learners' notebooks "
                         "(one .ipynb per learner, or one folder per learner)")
    learners: dict[str, list] = {}
    for path in sorted(root.iterdir()):
        if path.name.startswith("."):
            continue
        if path.is_file() and path.suffix == ".ipynb":
            name, notebooks = path.stem, [path]
        elif path.is_dir():
            name = path.name
            notebooks = sorted(p for p in path.rglob("*.ipynb")
                               if not any(part.startswith(".") for part in p.relative_to(path).parts))
        else:
            continue
        if name in learners:
            raise GradeError(f"{root}: {name!r} is both a notebook and a folder; which one is the learner's?")
        learners[name] = notebooks
    if not any(learners.values()):
        raise GradeError(f"{root} holds no .ipynb files: expected one notebook per learner (alice.ipynb) or one "
                         "folder of notebooks per learner (alice/01_callables.ipynb)")
    return learners


def _exercise_order(ex_id: str):
    major, _, minor = ex_id.partition(".")
    return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else (999, 0)


def _solution_calls(source: str) -> list[str]:
    """Exercise ids of `solution(...)` calls written in a cell ("?" for an id that is not a literal)."""
    import ast
    import re
    try:
        tree = ast.parse(source)
    except SyntaxError:  # IPython magics: fall back to the text
        return [m.group(1) or "?" for m in re.finditer(r"\bsolution\(\s*(?:[\"'](\d\d\.\d+)[\"'])?", source)]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name == "solution":
                arg = node.args[0] if node.args else None
                found.append(arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else "?")
    return found


def _answer_name(source: str, ex_id: str, default: str) -> str:
    """The name the cell hands to check(ex_id, NAME), else the exercise's own answer name."""
    import re
    match = re.search(r"""check\(\s*["']%s["']\s*,\s*([A-Za-z_]\w*)\s*\)""" % re.escape(ex_id), source)
    return match.group(1) if match else default


def _distinctive(ex) -> str | None:
    """The reference solution, when it is long enough that finding it verbatim in a cell is no coincidence."""
    new = [line for line in ex.solution.splitlines() if line.strip() and line not in ex.blank.splitlines()]
    return ex.solution.strip() if len(new) >= 3 else None


def _fingerprint(root, limit: int = 20000) -> dict:
    """{relative path: (size, mtime_ns)} of up to `limit` entries under root (for a before/after comparison).

    The grader's own stdout and stderr are left out: `grade ... > log.txt` changes log.txt."""
    own = set()
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
            own.add((st.st_dev, st.st_ino))
        except OSError:
            pass
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in (".git", ".venv", "__pycache__", "node_modules")
                       and not d.startswith("course-grade-")]  # the grader's own temporary folders
        for name in [*filenames, *dirnames]:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in own:
                continue
            found[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
            if len(found) >= limit:
                return found
    return found


def _changes(before: dict, after: dict) -> list[str]:
    gone = sorted(set(before) - set(after))
    new = sorted(set(after) - set(before))
    edited = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    out = [f"deleted {p}" for p in gone] + [f"created {p}" for p in new] + [f"modified {p}" for p in edited]
    return out[:5] + ([f"and {len(out) - 5} more"] if len(out) > 5 else [])


def _kernel_env(work: str, limits: Limits) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k in ("PATH", "LANG", "LANGUAGE", "PYTHONPATH", "LD_LIBRARY_PATH", "SYSTEMROOT", "TZ")
           or k.startswith(("LC_", "COURSE_")) or (limits.gpu and k.startswith(("CUDA_", "NVIDIA_")))}
    env.update(HOME=work, TMPDIR=os.path.join(work, "tmp"), XDG_CACHE_HOME=os.path.join(work, ".cache"),
               XDG_CONFIG_HOME=os.path.join(work, ".config"), MPLCONFIGDIR=os.path.join(work, ".matplotlib"),
               IPYTHONDIR=os.path.join(work, ".ipython"), JUPYTER_CONFIG_DIR=os.path.join(work, ".jupyter"),
               JUPYTER_RUNTIME_DIR=os.path.join(work, ".jupyter-runtime"), TORCH_HOME=os.path.join(work, ".torch"),
               PYTHONDONTWRITEBYTECODE="1", MALLOC_ARENA_MAX="2", PYDEVD_DISABLE_FILE_VALIDATION="1",
               PYTHONUNBUFFERED="1")
    if not limits.gpu:
        env.update(CUDA_VISIBLE_DEVICES="", COURSE_DEVICE="cpu")
    return env


def _message_size(msg: dict) -> int:
    """Roughly the bytes a kernel message carries (text, rich data, widget state, binary buffers, tracebacks)."""
    content = msg.get("content", {})
    size = len(str(content.get("text", ""))) + sum(len(str(v)) for v in (content.get("data") or {}).values())
    size += sum(len(b) for b in msg.get("buffers", []) or [] if hasattr(b, "__len__"))
    return size + sum(len(str(line)) for line in content.get("traceback", []) or []) + len(str(content.get("evalue", "")))


def _exit_reason(code, limits: Limits) -> str:
    if code is None:
        return "the kernel stopped responding"
    sig = code - 128 if code > 128 else (-code if code < 0 else 0)
    if sig == getattr(signal, "SIGXCPU", -1):
        return f"it used more than {limits.cpu} s of CPU time (RLIMIT_CPU), so the OS stopped its kernel"
    if sig == signal.SIGKILL:
        return "its kernel was killed (SIGKILL): the system ran out of memory, or the notebook killed it"
    if sig:
        try:
            return f"its kernel died from signal {signal.Signals(sig).name}"
        except ValueError:
            return f"its kernel died from signal {sig}"
    return (f"its kernel exited (status {code}): the notebook's code ended its own process "
            "(os._exit, exit(), a kill of its own process)")


class _Grading:
    """Grade one notebook. Call run(); the result is self.result (a NotebookRun)."""

    def __init__(self, learner: str, path, name: str, registry: dict, limits: Limits, sandbox: Sandbox):
        self.result = NotebookRun(learner, path, name)
        self.registry, self.limits, self.sandbox = registry, limits, sandbox

    # --- the notebook, with the grader's cells added -----------------------------------------------------------

    def _prepare(self):
        import secrets

        import nbformat

        from .solve import exercise_cells
        size = os.path.getsize(self.result.path)
        if size > _MAX_NOTEBOOK:
            raise ValueError(f"{format_size(size)}, more than the {format_size(_MAX_NOTEBOOK)} a notebook may have")
        nb = nbformat.read(self.result.path, as_version=4)
        code_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
        ex_cells: dict[int, list[str]] = {}
        for i, ex_id in exercise_cells(nb):
            if ex_id not in self.registry:
                self.result.notes.append(f"cell {i + 1} checks exercise {ex_id}, which the course does not have")
            elif ex_id not in [e for ids in ex_cells.values() for e in ids]:
                ex_cells.setdefault(i, []).append(ex_id)
        self.exercises = [e for ids in ex_cells.values() for e in ids]
        self.flags: dict[str, list[str]] = {e: [] for e in self.exercises}
        for i in code_cells:
            source = nb.cells[i].source
            for called in _solution_calls(source):
                key = called if called in self.flags else None
                text = (f"calls solution({called!r}) in cell {i + 1}" if called != "?"
                        else f"calls solution(...) in cell {i + 1}")
                if key:
                    self.flags[key].append(text)
                elif text not in self.result.notes:
                    self.result.notes.append(text)
        for i, ids in ex_cells.items():
            for ex_id in ids:
                text = _distinctive(self.registry[ex_id])
                if text and text in nb.cells[i].source:
                    self.flags[ex_id].append("the cell contains the reference solution verbatim")
        self.private = f"course_utils._grader_{secrets.token_hex(8)}"
        run = nbformat.v4.new_notebook(metadata=nb.metadata)
        token = secrets.token_hex(16)
        setup = {"private": self.private, "exercises_dir": os.path.dirname(os.path.abspath(__file__)),
                 "course_dir": os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
                 "workdir": self.work, "token": token, "grader_pid": os.getpid(),
                 "solutions": {k: ex.solution.strip() for k, ex in self.registry.items() if ex.solution.strip()}}
        run.cells.append(self._grader_cell(_KERNEL_SETUP % {"args": json.dumps(setup)}, kind="setup", token=token))
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            cell = nbformat.v4.new_code_cell(cell.source)  # the learner's code, without its saved outputs/tags
            cell.metadata["grader"] = {"kind": "learner", "index": i}
            run.cells.append(cell)
            for ex_id in ex_cells.get(i, []):
                token = secrets.token_hex(16)
                source = _KERNEL_EVAL % {"private": self.private, "id": ex_id,
                                         "answer": _answer_name(nb.cells[i].source, ex_id,
                                                                self.registry[ex_id].answer), "token": token}
                run.cells.append(self._grader_cell(source, kind="eval", token=token, id=ex_id, index=i))
        self.total_cells = len(nb.cells)
        return run

    @staticmethod
    def _grader_cell(source: str, **meta):
        import nbformat
        cell = nbformat.v4.new_code_cell(source)
        cell.metadata["grader"] = meta
        return cell

    # --- running ---------------------------------------------------------------------------------------------

    def run(self) -> NotebookRun:
        import tempfile
        start = time.monotonic()
        # Unix socket paths are limited to about 100 bytes: keep the folder's path short.
        short = os.name == "posix" and len(tempfile.gettempdir()) > 40 and os.path.isdir("/tmp")
        base = tempfile.mkdtemp(prefix="course-grade-", dir="/tmp" if short else None)
        self.ipc, self.work = os.path.join(base, "ipc"), os.path.join(base, "work")
        os.makedirs(self.ipc)
        os.makedirs(self.work)
        try:
            try:
                run_nb = self._prepare()
            except Exception as exc:
                self.result.status, self.result.detail = "unreadable", f"not a readable notebook: {exc}"
                self.exercises = []
                return self.result
            if not self.exercises:
                self.result.status, self.result.detail = "no exercises", "checks no exercise of the course; not run"
                return self.result
            self._execute(run_nb)
        finally:
            self.result.seconds = time.monotonic() - start
            import shutil
            shutil.rmtree(base, ignore_errors=True)
        return self.result

    def _execute(self, run_nb) -> None:
        from jupyter_client.manager import AsyncKernelManager
        from nbclient import NotebookClient
        from nbclient.exceptions import CellTimeoutError, DeadKernelError

        grading = self
        limits = self.limits

        class KernelManager(AsyncKernelManager):
            def format_kernel_cmd(self, extra_arguments=None):
                return grading._kernel_cmd(list(extra_arguments or []))

        class Client(NotebookClient):
            def process_message(self, msg, cell, cell_index):
                grading.output_bytes += _message_size(msg)  # every message counts: output, widgets, errors
                if grading.output_bytes > limits.output:
                    if not grading.over_cap:
                        grading.over_cap = True
                        grading._kill()
                    if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                        return super().process_message(msg, cell, cell_index)
                    return None
                return super().process_message(msg, cell, cell_index)

            def output(self, outs, msg, display_id, cell_index):
                if msg["msg_type"] == "stream" and "Reference solution for " in msg["content"].get("text", ""):
                    import re
                    for ex_id in re.findall(r"Reference solution for (\d\d\.\d+)", msg["content"]["text"]):
                        grading.printed_solutions.add(ex_id)
                if self.nb.cells[cell_index].metadata["grader"]["kind"] == "learner":
                    return None  # learner output is not kept (or trusted)
                return super().output(outs, msg, display_id, cell_index)

        self.output_bytes, self.over_cap, self.printed_solutions = 0, False, set()
        self.spent, self.process = 0.0, None

        def timeout_for(cell):
            meta = cell.metadata["grader"]
            if meta["kind"] == "learner":
                return max(1, int(limits.timeout - self.spent + 0.999))
            if meta["kind"] == "eval":
                return int(self.registry[meta["id"]].timeout) + 30
            return 180

        def on_executed(cell, cell_index, execute_reply):
            content = (execute_reply or {}).get("content", {})
            if content.get("status") == "error" and cell.metadata["grader"]["kind"] == "learner":
                where = cell.metadata["grader"]["index"] + 1
                evalue = str(content.get("evalue", ""))[:200]
                text = f"cell {where} raised {content.get('ename')}" + (f": {evalue}" if evalue else "")
                if content.get("ename") == "MemoryError" and limits.memory:
                    text += f" (the memory limit is {format_size(limits.memory)} of address space)"
                if len(self.errors) < 5:
                    self.errors.append(text)
                elif len(self.errors) == 5:
                    self.errors.append("and more cells raised errors")

        self.errors: list[str] = []
        client = Client(run_nb, kernel_name="python3", kernel_manager_class=KernelManager, allow_errors=True,
                        timeout_func=timeout_for, startup_timeout=120, shutdown_kernel="immediate",
                        iopub_timeout=5, raise_on_iopub_timeout=False, record_timing=False, store_widget_state=False,
                        skip_cells_with_tag="grader-never-skips-" + self.private, on_cell_executed=on_executed)
        km = client.create_kernel_manager()
        if os.name == "posix":
            km.transport, km.ip = "ipc", os.path.join(self.ipc, "k")
        km.connection_file = os.path.join(self.ipc, "kernel.json")
        lock = self._lock()
        stopped_in = None
        try:
            os.makedirs(os.path.join(self.work, "tmp"), exist_ok=True)
            with client.setup_kernel(cwd=self.work, env=_kernel_env(self.work, limits)):
                self.process = getattr(km.provisioner, "process", None)
                self._read_sandbox_status()
                try:
                    for index, cell in enumerate(run_nb.cells):
                        meta = cell.metadata["grader"]
                        stopped_in = meta
                        if meta["kind"] == "learner" and self.spent >= limits.timeout:
                            raise CellTimeoutError("the notebook's time is used up")
                        began = time.monotonic()
                        client.execute_cell(cell, index, store_history=meta["kind"] == "learner")
                        if meta["kind"] == "learner":
                            self.spent += time.monotonic() - began
                        else:
                            self._collect(cell, meta)
                    stopped_in = None
                finally:
                    self._kill()  # the kernel and whatever it started, before the pid can be reused
        except CellTimeoutError:
            self._stopped(stopped_in, "time limit", self._timeout_text(stopped_in))
        except DeadKernelError:
            if self.over_cap:
                self._stopped(stopped_in, "output cap", f"it printed more than {format_size(limits.output)} of "
                                                        "output, so the grader stopped its kernel")
            else:
                self._stopped(stopped_in, "kernel died", _exit_reason(self._exit_code(), limits))
        except _SetupFailed as exc:
            self._stopped(None, "could not run", str(exc))
        except Exception as exc:  # the kernel could not start, or the connection broke
            if self.over_cap:
                self._stopped(stopped_in, "output cap", f"it printed more than {format_size(limits.output)} of "
                                                        "output, so the grader stopped its kernel")
            else:
                log = self._log_tail()
                self._stopped(stopped_in, "could not run",
                              f"the grader could not run it: {type(exc).__name__}: {exc}" + (f" ({log})" if log else ""))
        finally:
            os.close(lock)
        self.result.notes[:0] = self.errors
        for ex_id in self.exercises:
            if ex_id not in self.result.outcomes:
                self.result.outcomes[ex_id] = Outcome(NOT_RUN, f"not checked: {self.result.detail}",
                                                      self.result.name)
            outcome = self.result.outcomes[ex_id]
            if any(f.startswith(f"calls solution({ex_id!r})") for f in self.flags[ex_id]):
                outcome.flags = [f for f in outcome.flags if f != f"called solution({ex_id!r})"]
            outcome.flags = list(dict.fromkeys(self.flags[ex_id] + outcome.flags + (
                [f"printed the reference solution of {ex_id} (solution())"] if ex_id in self.printed_solutions
                else [])))

    def _kernel_cmd(self, extra: list[str]) -> list[str]:
        # Output written straight to the process's stdout/stderr (os.write, C extensions, subprocesses) goes to a
        # log file capped by RLIMIT_FSIZE instead of being forwarded to the grader.
        cmd = [sys.executable, "-m", "ipykernel_launcher", "-f", os.path.join(self.ipc, "kernel.json"),
               "--IPKernelApp.capture_fd_output=False", *extra]
        if os.name != "posix":
            return cmd
        rlimits = {"FSIZE": self.limits.file_size, "CPU": self.limits.cpu, "CORE": 0}
        if self.limits.memory:
            rlimits["AS"] = self.limits.memory
        config = {"work": self.work, "ipc": self.ipc, "lock": os.path.join(self.ipc, "grader.lock"),
                  "log": os.path.join(self.ipc, "kernel.log"), "status": os.path.join(self.ipc, "sandbox.json"),
                  "protect_fs": self.sandbox.mounts, "disk": self.limits.disk, "rlimits": rlimits,
                  "env": _kernel_env(self.work, self.limits)}
        config_path = os.path.join(self.ipc, "sandbox-config.json")
        with open(config_path, "w") as f:
            json.dump(config, f)
        launcher = [sys.executable, "-I", "-S", os.path.abspath(__file__), "--sandbox", config_path, "--"]
        return [*self.sandbox.prefix, *launcher, *cmd]

    def _lock(self) -> int:
        fd = os.open(os.path.join(self.ipc, "grader.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        if os.name == "posix":
            import fcntl
            fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def _kill(self) -> None:
        """Stop the kernel and everything in its process group, now."""
        process = self.process
        if process is None:
            return
        try:
            if os.name == "posix":
                os.killpg(process.pid, signal.SIGKILL)
            else:
                process.kill()
        except (ProcessLookupError, PermissionError, OSError):
            pass

    def _exit_code(self):
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout=5)
        except Exception:
            return None

    def _read_sandbox_status(self) -> None:
        try:
            with open(os.path.join(self.ipc, "sandbox.json")) as f:
                self.result.sandbox = json.load(f)
        except (OSError, ValueError):
            self.result.sandbox = {}

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.ipc, "kernel.log"), errors="replace") as f:
                lines = [line.strip() for line in f.read()[-2000:].splitlines() if line.strip()]
            return " / ".join(lines[-3:])
        except OSError:
            return ""

    def _timeout_text(self, meta) -> str:
        if meta and meta["kind"] == "eval":
            return (f"checking exercise {meta['id']} did not finish (the answer's code kept running after the "
                    "check's own time limit), so the grader stopped the kernel")
        return f"it ran longer than the time limit of {self.limits.timeout:g} s, so the grader stopped its kernel"

    def _stopped(self, meta, status: str, reason: str) -> None:
        where = ""
        if meta and meta["kind"] in ("learner", "eval"):
            where = f" in cell {meta['index'] + 1} of {self.total_cells}"
        elif meta and meta["kind"] == "setup":
            where = " while the grader was setting up its kernel"
        self.result.status, self.result.detail = status, f"{reason}{where}"
        if meta and meta["kind"] == "eval":
            self.result.outcomes[meta["id"]] = Outcome(INCORRECT, f"the check of this answer was stopped: {reason}",
                                                       self.result.name)

    def _collect(self, cell, meta) -> None:
        """Read the grader's framed result from its own cell's output (and nothing else)."""
        token = meta["token"]
        payload = None
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stdout":
                for line in out.get("text", "").splitlines():
                    if line.startswith(token + " "):
                        try:
                            data = json.loads(line[len(token) + 1:])
                        except ValueError:
                            continue
                        if data.get("token") == token:
                            payload = data
            elif out.get("output_type") == "error" and meta["kind"] == "setup":
                hint = ""
                if self.limits.memory and out.get("ename") in ("ImportError", "MemoryError", "OSError"):
                    hint = (f"; is the memory limit ({format_size(self.limits.memory)} of address space) too small? "
                            "Importing torch alone needs about 3.5 GiB: raise --memory")
                raise _SetupFailed(f"the grader's own setup failed in the kernel: {out.get('ename')}: "
                                   f"{out.get('evalue')}{hint}")
        if meta["kind"] == "setup":
            if not payload:
                raise _SetupFailed("the grader's setup cell gave no answer")
            return
        ex_id = meta["id"]
        if payload is None or payload.get("id") != ex_id or payload.get("status") not in _RANK:
            self.result.outcomes[ex_id] = Outcome(
                NOT_RUN, "the grader's check gave no result: the notebook's code interfered with the grader "
                         "(its own private checker or its output)", self.result.name,
                ["interfered with the grader's check"])
            return
        self.result.outcomes[ex_id] = Outcome(payload["status"], payload["message"], self.result.name,
                                              payload.get("flags", []))
        for text in payload.get("tamper", []):
            if text not in self.result.notes:
                self.result.notes.append(text)


class ClassReport:
    def __init__(self, root, learners: dict, runs: dict, registry: dict, limits: Limits, sandbox: Sandbox):
        self.root, self.registry, self.limits, self.sandbox = root, registry, limits, sandbox
        self.runs = runs                      # {learner: [NotebookRun]}
        self.learners = list(learners)
        found = {e for rs in runs.values() for r in rs for e in r.outcomes}
        self.exercises = sorted(found, key=_exercise_order)
        self.table: dict[str, dict[str, Outcome]] = {}
        for learner in self.learners:
            row = {}
            for ex_id in self.exercises:
                candidates = [r.outcomes[ex_id] for r in runs[learner] if ex_id in r.outcomes]
                if not candidates:
                    row[ex_id] = Outcome(NOT_ATTEMPTED, "no notebook of this learner checks this exercise")
                    continue
                best = min(candidates, key=lambda o: _RANK[o.status])
                if len(candidates) > 1:
                    others = [o.notebook for o in candidates if o is not best]
                    best.flags.append(f"also checked in {', '.join(others)}")
                row[ex_id] = best
            self.table[learner] = row
        self.generated = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        self.guarded: list[str] = []  # the folders checked for changes after each notebook

    def score(self, learner: str) -> int:
        return sum(o.status == CORRECT for o in self.table[learner].values())

    def containment(self) -> list[tuple[bool, str, str]]:
        """(applied, what, detail) for each protection, from what the kernels reported."""
        statuses = [r.sandbox for rs in self.runs.values() for r in rs if r.sandbox]
        limits, sb = self.limits, self.sandbox

        def rlimit(name):
            if os.name != "posix":
                return False, f"resource limits are POSIX-only (this is {sys.platform})"
            if not statuses:
                return False, "no kernel reported its limits"
            missing = [m[1] for s in statuses for m in s.get("missing", []) if m[0] == "RLIMIT_" + name]
            if missing:
                return False, f"could not be applied: {missing[0]}"
            if any("RLIMIT_" + name not in s.get("applied", []) for s in statuses):
                return False, "not applied in every kernel"
            return True, ""

        items = [(True, "Own kernel process per notebook, empty temporary working directory (also HOME and TMPDIR)",
                  "each notebook runs in a fresh kernel; nothing is shared between learners"),
                 (True, f"Time limit: {limits.timeout:g} s of wall-clock time per notebook",
                  "the grader stops the kernel when it is reached"),
                 (True, f"Output cap: {format_size(limits.output)} of output per notebook",
                  "the grader stops the kernel when it is reached; outputs are not kept")]
        if limits.memory:
            ok, why = rlimit("AS")
            items.append((ok, f"Memory limit: {format_size(limits.memory)} of address space (RLIMIT_AS)", why))
        else:
            items.append((False, "Memory limit (RLIMIT_AS)",
                          "not applied with --gpu: CUDA reserves more address space than any useful limit"
                          if limits.gpu else "not applied: --memory 0"))
        ok, why = rlimit("CPU")
        items.append((ok, f"CPU time limit: {limits.cpu} s (RLIMIT_CPU)", why))
        ok, why = rlimit("FSIZE")
        items.append((ok, f"Largest file a notebook may write: {format_size(limits.file_size)} (RLIMIT_FSIZE)", why))
        items.append(("net" in sb.namespaces, "No network (a new network namespace, `unshare --net`)",
                      "" if "net" in sb.namespaces else f"not isolated: {sb.why_not}"))
        items.append(("pid" in sb.namespaces, "Own PID namespace: cannot see or signal the grader; all its "
                                              "processes stop with it",
                      "" if "pid" in sb.namespaces else f"not applied: {sb.why_not}; the audit hook refuses "
                                                         "os.kill of the kernel's parent"))
        fs_missing = [m[1] for s in statuses for m in s.get("missing", []) if m[0] == "filesystem"]
        fs_ok = sb.mounts and bool(statuses) and not fs_missing
        items.append((fs_ok, f"Read-only file system except the working directory (a {format_size(limits.disk)} "
                             "tmpfs), kernel without capabilities",
                      "" if fs_ok else "not applied: " + (fs_missing[0] if fs_missing else sb.why_not or
                                                         "no mount namespace") +
                      "; only the audit hook refuses Python-level writes outside the working directory"))
        items.append((True, "Audit hook in the kernel: Python-level writes, deletions and renames outside the "
                            "working directory are refused", "code that starts processes or uses ctypes is not "
                                                             "covered by it"))
        items.append((True, "Checked for changes after each notebook: " + ", ".join(self.guarded),
                      "" if len(self.guarded) > 1 else "the grader's working directory is a shared folder (temporary "
                                                  "folder, home or /), which other programs change: not checked"))
        items.append((not limits.gpu, "GPU hidden from the notebooks (CUDA_VISIBLE_DEVICES='', COURSE_DEVICE=cpu)",
                      "" if not limits.gpu else "--gpu: the notebooks may use the GPU"))
        return items

    def summary(self) -> list[dict]:
        """Per exercise: counts of each status and the most common mistakes."""
        import re
        from collections import Counter
        rows = []
        for ex_id in self.exercises:
            ex = self.registry.get(ex_id)
            outcomes = [self.table[learner][ex_id] for learner in self.learners]
            counts = Counter(o.status for o in outcomes)
            mistakes = Counter()
            for o in outcomes:
                if o.status != INCORRECT:
                    continue
                known = next((m.feedback for m in (ex.mistakes if ex else []) if m.feedback in o.message), None)
                key = f"known mistake: \u201c{known}\u201d" if known else re.sub(r"\d+(\.\d+)?", "#", o.message)[:160]
                mistakes[key] += 1
            rows.append({"id": ex_id, "title": ex.title if ex else "", "counts": counts,
                         "mistakes": mistakes.most_common(5)})
        return rows

    # --- output ------------------------------------------------------------------------------------------------

    def write_csv(self, path) -> None:
        import csv
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["learner", "exercise", "status", "feedback", "flags", "notebook", "notebook_status"])
            for learner in self.learners:
                by_name = {r.name: r for r in self.runs[learner]}
                for ex_id in self.exercises:
                    o = self.table[learner][ex_id]
                    run = by_name.get(o.notebook)
                    writer.writerow([learner, ex_id, o.status, o.message, "; ".join(o.flags), o.notebook,
                                     f"{run.status}: {run.detail}" if run and run.detail else (run.status if run else "")])

    def write_html(self, path) -> None:
        from html import escape
        icons = {CORRECT: "\u2713 correct", INCORRECT: "\u2717 incorrect", NOT_ATTEMPTED: "\u2013 not attempted",
                 NOT_RUN: "\u26a0 not run"}
        parts = [f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Grades: {escape(str(self.root))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 4px 6px; vertical-align: top; text-align: left; }}
td.correct {{ background: #e3f5e1; }} td.incorrect {{ background: #fde2e1; }}
td.not-attempted {{ background: #f0f0f0; color: #666; }} td.not-run {{ background: #fff3cd; }}
td .fb {{ font-size: 0.8em; max-width: 22em; }} .flag {{ font-size: 0.8em; color: #8a4b00; }}
.ok {{ color: #1a7f37; }} .no {{ color: #b42318; font-weight: bold; }} .alert {{ color: #b42318; font-weight: bold; }}
</style></head><body>
<h1>Grades: {escape(str(self.root))}</h1>
<p>{len(self.learners)} learners, {len(self.exercises)} exercises; graded {escape(self.generated)} with
<code>python -m course_utils.exercises grade</code>. Every result comes from the course's own checker, run by the
grader in the learner's kernel after the learner's cell; the notebooks' saved outputs are ignored.</p>
<h2>Containment</h2><ul>"""]
        for ok, what, detail in self.containment():
            mark = '<span class="ok">applied</span>' if ok else '<span class="no">NOT applied</span>'
            parts.append(f"<li>{mark}: {escape(what)}{': ' + escape(detail) if detail else ''}</li>")
        parts.append("</ul><h2>Results</h2><table><thead><tr><th>learner</th><th>score</th>")
        for ex_id in self.exercises:
            title = self.registry[ex_id].title if ex_id in self.registry else ""
            parts.append(f'<th title="{escape(title)}">{escape(ex_id)}</th>')
        parts.append("<th>notebooks</th></tr></thead><tbody>")
        for learner in self.learners:
            parts.append(f"<tr><th>{escape(learner)}</th><td>{self.score(learner)}/{len(self.exercises)}</td>")
            for ex_id in self.exercises:
                o = self.table[learner][ex_id]
                css = o.status.replace(" ", "-")
                flags = "".join(f'<div class="flag">\u2691 {escape(f)}</div>' for f in o.flags)
                fb = "" if o.status == CORRECT and not o.flags else f'<div class="fb">{escape(o.message)}</div>'
                parts.append(f'<td class="{css}" data-learner="{escape(learner)}" data-exercise="{escape(ex_id)}" '
                             f'data-status="{escape(o.status)}">{icons[o.status]}{fb}{flags}</td>')
            cells = []
            for r in self.runs[learner]:
                text = f"{escape(r.name)}: {escape(r.status)}" + (f" ({escape(r.detail)})" if r.detail else "")
                text += f", {r.seconds:.1f} s"
                text += "".join(f'<div class="alert">\u26a0 {escape(a)}</div>' for a in r.alerts)
                text += "".join(f'<div class="flag">{escape(n)}</div>' for n in r.notes)
                cells.append(f"<div>{text}</div>")
            parts.append(f'<td class="runs" data-learner="{escape(learner)}">'
                         f'{"".join(cells) or "no notebooks"}</td></tr>')
        parts.append("</tbody></table><h2>Per exercise</h2><table><thead><tr><th>exercise</th><th>correct</th>"
                     "<th>incorrect</th><th>not attempted</th><th>not run</th><th>most common mistakes</th></tr>"
                     "</thead><tbody>")
        for row in self.summary():
            c = row["counts"]
            mistakes = "".join(f"<div>{n} \u00d7 {escape(text)}</div>" for text, n in row["mistakes"]) or "\u2013"
            parts.append(f'<tr data-exercise="{escape(row["id"])}"><th>{escape(row["id"])} {escape(row["title"])}'
                         f"</th><td>{c[CORRECT]}</td><td>{c[INCORRECT]}</td><td>{c[NOT_ATTEMPTED]}</td>"
                         f"<td>{c[NOT_RUN]}</td><td>{mistakes}</td></tr>")
        parts.append("</tbody></table></body></html>\n")
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(parts))


def grade(submissions, limits: Limits | None = None, jobs: int = 1, progress=None) -> ClassReport:
    """Grade every learner's notebooks under `submissions`; return the ClassReport."""
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from . import load_all
    limits = limits or Limits()
    root = Path(submissions)
    learners = find_submissions(root)
    registry = dict(load_all())
    sandbox = Sandbox.probe()
    import tempfile
    # The submissions folder, and the grader's working directory unless it is a folder every program writes to.
    shared = {os.path.realpath(tempfile.gettempdir()), os.path.realpath(os.path.expanduser("~")), "/"}
    guarded = {str(root.resolve()): None}
    if os.path.realpath(os.getcwd()) not in shared:
        guarded[os.getcwd()] = None
    for key in guarded:
        guarded[key] = _fingerprint(key)
    tasks = [(learner, path) for learner, paths in learners.items() for path in paths]

    active: set[_Grading] = set()

    def one(task):
        learner, path = task
        name = str(path.relative_to(root / learner)) if path.parent != root else path.name
        grading = _Grading(learner, path, name, registry, limits, sandbox)
        active.add(grading)
        try:
            result = grading.run()
        finally:
            active.discard(grading)
        for key, before in guarded.items():
            after = _fingerprint(key)
            changes = _changes(before, after)
            if changes:
                guarded[key] = after
                also = ", or by a notebook running at the same time" if jobs > 1 else ""
                result.alerts.append(f"files in {key} changed while it ran (by this notebook{also}, or by another "
                                     f"program): {', '.join(changes)}")
        if progress:
            progress(result)
        return result

    runs: dict[str, list[NotebookRun]] = {learner: [] for learner in learners}
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        for result in pool.map(one, tasks):
            runs[result.learner].append(result)
    except BaseException:  # Ctrl-C: stop every kernel now rather than after its notebook
        pool.shutdown(wait=False, cancel_futures=True)
        for grading in list(active):
            grading._kill()
        raise
    pool.shutdown()
    report = ClassReport(root, learners, runs, registry, limits, sandbox)
    report.guarded = list(guarded)
    return report


# ============================================================================================================
# Command line: `python -m course_utils.exercises grade ...`
# ============================================================================================================

def add_arguments(parser) -> None:
    import argparse
    from pathlib import Path

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
    parser.add_argument("--gpu", action="store_true", help="let the notebooks use the GPU (no memory limit then)")


def main(args) -> int:
    import logging
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
        counts = {s: sum(o.status == s for o in run.outcomes.values()) for s in _RANK}
        done = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        detail = f" ({run.detail})" if run.detail else ""
        print(f"{run.learner} / {run.name}: {run.status}{detail} in {run.seconds:.1f} s; {done or 'no exercises'}",
              flush=True)
        for alert in run.alerts:
            print(f"  WARNING: {alert}", flush=True)

    try:
        limits = Limits(timeout=args.timeout, memory=args.memory, cpu=args.cpu, output=args.output,
                        file_size=args.file_size, disk=args.disk, gpu=args.gpu)
        report = grade(args.submissions, limits, jobs=args.jobs, progress=progress)
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
