"""The grading run: each notebook in a contained fresh kernel with the grader's cells added, then `grade()`.

`grade(SUBMISSIONS, Limits(...))` finds the learners' notebooks, runs each one (`_Grading`: the notebook's code
cells with the grader's own cells of `kernel` added, in a kernel started by the `sandbox` launcher), reads each
exercise's framed result, checks the watched folders after each notebook and returns the `report.ClassReport`.
"""
from __future__ import annotations

import ast
import base64
import json
import os
import queue
import re
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import time
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import run_sync
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError

import course_utils.exercises as exercises

from ..solve import exercise_cells
from . import kernel
from .limits import GradeError, Limits, format_size
from .judging import Judge, JudgeFailed
from .report import ClassReport
from .results import CORRECT, INCORRECT, INTERFERED, NOT_ATTEMPTED, NOT_RUN, NotebookRun, Outcome
from .sandbox import Sandbox
from .submissions import Unreadable, find_submissions, notebook_name, read_notebook

# The checkers the grader loads afresh in each kernel, and the course's folder (code compiled from there is its own).
EXERCISES_DIR = os.path.dirname(os.path.abspath(exercises.__file__))
COURSE_DIR = os.path.dirname(EXERCISES_DIR) + os.sep
# What a kernel needs to see (Python, its packages, the course, the launcher): a folder holding one is never hidden.
NEEDED = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable),
                                               os.path.dirname(COURSE_DIR.rstrip(os.sep)), os.path.dirname(__file__),
                                               *os.environ.get("PYTHONPATH", "").split(os.pathsep)) if p})
# Where the root grader's kernels get a uid of their own (random in [2e9, 3e9), used by no account).
_KERNEL_UIDS = 2_000_000_000


class _SetupFailed(Exception):
    """The grader's own first cell failed in the kernel (a limit too tight for importing torch, ...)."""


def _solution_calls(source: str) -> list[str]:
    """Exercise ids of `solution(...)` calls written in a cell ("?" for an id that is not a literal)."""
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
               PYTHONUNBUFFERED="1", USER="learner", LOGNAME="learner")
    if not limits.gpu:
        env.update(CUDA_VISIBLE_DEVICES="", COURSE_DEVICE="cpu")
    return env


def _message_size(msg: dict) -> int:
    """Roughly the bytes a kernel message carries (text, rich data, widget state, binary buffers, tracebacks)."""
    size = sum(len(str(msg.get(part, ""))) for part in ("header", "parent_header", "metadata", "content"))
    return size + sum(len(b) for b in msg.get("buffers", []) or [] if hasattr(b, "__len__"))


def _read_own(path: str, limit: int) -> bytes:
    """The last `limit` bytes of a file in the kernel's ipc folder, which the kernel may write to: a symbolic link
    (to a classmate's notebook, to /etc/shadow), a FIFO, a hard link or anything but a plain file is not read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise OSError(f"{path}: not a file of the kernel's own")
        f.seek(max(0, st.st_size - limit))
        return f.read(limit)


def _malformed(msg: dict) -> bool:
    """A message from the kernel that does not have the shape of its type (a stream's text not a string, ...)."""
    content = msg.get("content")
    if not isinstance(content, dict):
        return True
    kind = msg.get("msg_type")
    transient = content.get("transient") or {}
    if not isinstance(transient, dict) or not isinstance(transient.get("display_id", ""), (str, type(None))):
        return True
    if kind == "stream":
        return not (isinstance(content.get("name"), str) and isinstance(content.get("text"), str))
    if kind in ("display_data", "execute_result", "update_display_data"):
        return not (isinstance(content.get("data", {}), dict) and isinstance(content.get("metadata", {}), dict))
    if kind == "error":
        return not (isinstance(content.get("ename", ""), str) and isinstance(content.get("evalue", ""), str)
                    and isinstance(content.get("traceback", []), list))
    if kind == "status":
        return not isinstance(content.get("execution_state"), str)
    return False


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

    def __init__(self, learner: str, path, name: str, registry: dict, limits: Limits, sandbox: Sandbox,
                 hide: list[str] = (), judge: Judge | None = None):
        self.result = NotebookRun(learner, path, name)
        self.registry, self.limits, self.sandbox, self.hide = registry, limits, sandbox, list(hide)
        self.judge = judge or Judge(limits.memory)

    # --- the notebook, with the grader's cells added -----------------------------------------------------------

    def _prepare(self):
        nb = read_notebook(self.result.path)
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
        for i, ids in ex_cells.items():  # the reference solution pasted verbatim, in the exercise's cell or another
            for ex_id in ids:
                text = _distinctive(self.registry[ex_id])
                if text and text in nb.cells[i].source:
                    self.flags[ex_id].append("the cell contains the reference solution verbatim")
                elif text:
                    self.flags[ex_id] += [f"cell {j + 1} contains the reference solution verbatim" for j in code_cells
                                          if text in nb.cells[j].source][:1]
        self.private = f"course_utils._grader_{secrets.token_hex(8)}"
        self.target = f"course_grader_{secrets.token_hex(8)}"  # the comm target of the grader's checks
        run = nbformat.v4.new_notebook(metadata=nb.metadata)
        token = secrets.token_hex(16)
        setup = {"private": self.private, "target": self.target, "exercises_dir": EXERCISES_DIR,
                 "course_dir": COURSE_DIR, "workdir": self.work, "token": token, "grader_pid": os.getpid(),
                 "solutions": {k: ex.solution.strip() for k, ex in self.registry.items() if ex.solution.strip()}}
        run.cells.append(self._grader_cell(kernel.SETUP % {"args": json.dumps(setup)}, kind="setup", token=token))
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            cell = nbformat.v4.new_code_cell(cell.source)  # the learner's code, without its saved outputs/tags
            cell.metadata["grader"] = {"kind": "learner", "index": i}
            run.cells.append(cell)
            for ex_id in ex_cells.get(i, []):  # sent as a comm message, not run as a cell (kernel.py)
                answer = _answer_name(nb.cells[i].source, ex_id, self.registry[ex_id].answer)
                run.cells.append(self._grader_cell(f"# the grader checks {ex_id} ({answer})", kind="eval",
                                                   token=secrets.token_hex(16), id=ex_id, index=i, answer=answer,
                                                   seed=secrets.randbits(63)))
        self.total_cells = len(nb.cells)
        return run

    @staticmethod
    def _grader_cell(source: str, **meta):
        cell = nbformat.v4.new_code_cell(source)
        cell.metadata["grader"] = meta
        return cell

    # --- running ---------------------------------------------------------------------------------------------

    def run(self) -> NotebookRun:
        start = time.monotonic()
        # Under /tmp where there is one: unix socket paths are limited to about 100 bytes, and the sandbox gives each
        # kernel a /tmp of its own (sandbox.py).
        base = tempfile.mkdtemp(prefix="course-grade-", dir="/tmp" if os.name == "posix" and os.path.isdir("/tmp")
                                else None)
        self.ipc, self.work = os.path.join(base, "ipc"), os.path.join(base, "work")
        os.makedirs(self.ipc)
        os.makedirs(self.work)
        try:
            try:
                run_nb = self._prepare()
            except Unreadable as exc:  # the reason only: nothing of what the file holds reaches the report
                self.result.status, self.result.detail = "unreadable", f"not graded: {exc}"
                self.exercises = []
                return self.result
            except Exception as exc:
                self.result.status, self.result.detail = "unreadable", f"not a readable notebook ({type(exc).__name__})"
                self.exercises = []
                return self.result
            if not self.exercises:
                self.result.status, self.result.detail = "no exercises", "checks no exercise of the course; not run"
                return self.result
            self._execute(run_nb)
        finally:
            self.result.seconds = time.monotonic() - start
            shutil.rmtree(base, ignore_errors=True)
        return self.result

    def _execute(self, run_nb) -> None:
        grading = self
        limits = self.limits

        class KernelManager(AsyncKernelManager):
            def format_kernel_cmd(self, extra_arguments=None):
                return grading._kernel_cmd(list(extra_arguments or []))

        class Client(NotebookClient):
            def process_message(self, msg, cell, cell_index):
                usable = grading._usable(msg)
                if grading.over_cap:
                    if usable and msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                        return super().process_message(msg, cell, cell_index)
                    return None
                if not usable:
                    return None
                try:
                    return super().process_message(msg, cell, cell_index)
                except (TypeError, AttributeError, KeyError, ValueError):  # a shape _malformed does not know
                    grading.malformed += 1
                    return None

            def output(self, outs, msg, display_id, cell_index):
                if msg["msg_type"] == "stream" and "Reference solution for " in msg["content"].get("text", ""):
                    for ex_id in re.findall(r"Reference solution for (\d\d\.\d+)", msg["content"]["text"]):
                        grading.printed_solutions.add(ex_id)
                if self.nb.cells[cell_index].metadata["grader"]["kind"] == "learner":
                    return None  # learner output is not kept (or trusted)
                return super().output(outs, msg, display_id, cell_index)

        self.output_bytes, self.over_cap, self.printed_solutions, self.malformed = 0, False, set(), 0
        self.spent, self.process, self.tamper, self.out_of_time = 0.0, None, [], False

        def timeout_for(cell):
            if cell.metadata["grader"]["kind"] == "learner":
                return max(1, int(limits.timeout - self.spent + 0.999))
            return 180  # the setup, before any of the learner's code

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
                self._count_every_message(client.kc)
                self._read_sandbox_status()
                try:
                    # Every cell after the setup counts against the time limit, the grader's checks included.
                    for index, cell in enumerate(run_nb.cells):
                        meta = cell.metadata["grader"]
                        stopped_in = meta
                        if meta["kind"] != "setup" and self.spent >= limits.timeout:
                            self.out_of_time = True
                            raise CellTimeoutError("the notebook's time is used up")
                        began = time.monotonic()
                        try:
                            if meta["kind"] == "eval":
                                run_sync(self._check)(client, cell, meta)
                            else:
                                client.execute_cell(cell, index, store_history=meta["kind"] == "learner")
                        finally:
                            if meta["kind"] != "setup":
                                self.spent += time.monotonic() - began
                        if meta["kind"] != "learner":
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
        self.result.counted = self.spent
        if self.malformed:
            self.errors.append(f"malformed output: the kernel sent {self.malformed} message(s) of the wrong shape "
                               "(a stream's text not a string, ...), ignored: the notebook's code sent them itself")
        self.result.notes[:0] = self.errors
        tamper = list(dict.fromkeys(self.tamper))
        for ex_id in self.exercises:
            if ex_id not in self.result.outcomes:
                self.result.outcomes[ex_id] = Outcome(NOT_RUN, f"not checked: {self.result.detail}",
                                                      self.result.name)
            outcome = self.result.outcomes[ex_id]
            if any(f.startswith(f"calls solution({ex_id!r})") for f in self.flags[ex_id]):
                outcome.flags = [f for f in outcome.flags if f != f"called solution({ex_id!r})"]
            outcome.flags = list(dict.fromkeys(self.flags[ex_id] + outcome.flags + (
                [f"printed the reference solution of {ex_id} (solution())"] if ex_id in self.printed_solutions
                else []) + tamper))

    def _count_every_message(self, kc) -> None:
        """Count every message the kernel sends on its output channel, whichever cell it names (nbclient drops those
        for other cells unseen), before anything else reads it."""
        channel = kc.iopub_channel
        get = channel.get_msg

        async def counted(*args, **kwargs):
            msg = await get(*args, **kwargs)
            self._count(msg)
            return msg

        channel.get_msg = counted

    def _count(self, msg: dict) -> None:
        """Count a kernel message against the output cap (every message the kernel sends, for any cell: output,
        widgets, metadata, errors); the kernel is stopped once over it."""
        self.output_bytes += _message_size(msg)
        if self.output_bytes > self.limits.output and not self.over_cap:
            self.over_cap = True
            self._kill()

    def _usable(self, msg: dict) -> bool:
        """Whether a message may be used: a malformed one (sent by the learner's code on purpose) is dropped and
        noted."""
        malformed = _malformed(msg)
        self.malformed += malformed
        return not malformed

    async def _check(self, client, cell, meta) -> None:
        """Ask the kernel to check one exercise through a comm message (no IPython hook runs for it) and keep its
        printed output in `cell.outputs`. Its time limit is the check's own plus 30 s, within the notebook's."""
        kc, limits = client.kc, self.limits
        own = self.registry[meta["id"]].timeout + 30
        left = limits.timeout - self.spent
        self.out_of_time = left <= own
        deadline = time.monotonic() + min(own, left)
        msg = kc.session.msg("comm_open", {"comm_id": secrets.token_hex(16), "target_name": self.target,
                                           "data": {"id": meta["id"], "answer": meta["answer"],
                                                    "token": meta["token"], "seed": meta["seed"]}})
        kc.shell_channel.send(msg)
        parent, text = msg["header"]["msg_id"], []
        while True:
            wait = deadline - time.monotonic()
            if wait <= 0:
                raise CellTimeoutError(f"the check of {meta['id']} did not finish")
            try:
                reply = await kc.get_iopub_msg(timeout=min(wait, 1))
            except queue.Empty:
                if not await client.km.is_alive():
                    raise DeadKernelError("the kernel died during a check") from None
                continue
            if self.over_cap:
                raise DeadKernelError("output cap")
            header = reply.get("parent_header")
            if not isinstance(header, dict) or header.get("msg_id") != parent or not self._usable(reply):
                continue
            content = reply["content"]
            if reply["msg_type"] == "stream" and content.get("name") == "stdout":
                text.append(content.get("text", ""))
            elif reply["msg_type"] == "status" and content.get("execution_state") == "idle":
                break
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="".join(text))]

    def _kernel_cmd(self, extra: list[str]) -> list[str]:
        # Output written straight to the process's stdout/stderr (os.write, C extensions, subprocesses) goes to a
        # log file capped by RLIMIT_FSIZE instead of being forwarded to the grader.
        cmd = [sys.executable, "-m", "ipykernel_launcher", "-f", os.path.join(self.ipc, "kernel.json"),
               "--IPKernelApp.capture_fd_output=False", *extra]
        if os.name != "posix":
            return cmd
        rlimits = {"FSIZE": self.limits.file_size, "CPU": self.limits.cpu, "CORE": 0, "NPROC": self.limits.processes}
        if self.limits.memory:
            rlimits["AS"] = self.limits.memory
        config = {"work": self.work, "ipc": self.ipc, "lock": os.path.join(self.ipc, "grader.lock"),
                  "log": os.path.join(self.ipc, "kernel.log"), "status": os.path.join(self.ipc, "sandbox.json"),
                  "connection": os.path.join(self.ipc, "kernel.json"), "protect_fs": self.sandbox.mounts,
                  "disk": self.limits.disk, "rlimits": rlimits, "env": _kernel_env(self.work, self.limits),
                  "hide": self.hide, "needed": NEEDED, "uid": _KERNEL_UIDS + secrets.randbelow(10 ** 9)}
        config_path = os.path.join(self.ipc, "sandbox-config.json")
        with open(config_path, "w") as f:
            json.dump(config, f)
        return self.sandbox.command(config_path, cmd)

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
            self.result.sandbox = json.loads(_read_own(os.path.join(self.ipc, "sandbox.json"), 2 ** 16))
        except (OSError, ValueError):
            self.result.sandbox = {}

    def _log_tail(self) -> str:
        """The last lines of the kernel's own log (its stdout and stderr)."""
        try:
            text = _read_own(os.path.join(self.ipc, "kernel.log"), 2000).decode("utf-8", "replace")
        except OSError:
            return ""
        return " / ".join([line.strip() for line in text.splitlines() if line.strip()][-3:])

    def _timeout_text(self, meta) -> str:
        if meta and meta["kind"] == "eval" and not self.out_of_time:
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
        if meta and meta["kind"] == "eval" and not (status == "time limit" and self.out_of_time):
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
        if payload and payload.get("id") == ex_id and payload.get("status") == "interfered":
            self.result.outcomes[ex_id] = Outcome(NOT_RUN, str(payload.get("message")), self.result.name,
                                                  ["changed the grader's private checker: no result"])
            return
        status = payload.get("status") if payload and payload.get("id") == ex_id else None
        # The kernel may only say what it recorded, or a result no better than "incorrect" (the answer is not
        # defined, the check itself raised): it never decides a pass.
        if status == "recorded" and isinstance(payload.get("message"), str):
            outcome = self._judge(ex_id, payload["message"], meta["seed"])
        elif status in (INCORRECT, NOT_ATTEMPTED) and isinstance(payload.get("message"), str):
            outcome = Outcome(status, payload["message"], self.result.name)
        else:
            outcome = Outcome(NOT_RUN, "the grader's check gave no result: the notebook's code interfered with the "
                                       "grader (its own private checker or its output)", self.result.name,
                              ["interfered with the grader's check"])
        outcome.flags += [str(f) for f in payload.get("flags", [])] if payload and outcome.status != NOT_RUN else []
        self.result.outcomes[ex_id] = outcome
        if payload:
            self.tamper += [str(t) for t in payload.get("tamper", [])]  # flagged on every exercise of the notebook

    def _judge(self, ex_id: str, text: str, seed: int) -> Outcome:
        """The verdict on what the learner's code produced, decided by the grader where no learner code runs
        (course_utils.exercises.judge, in the grader's judging process: judging.py)."""
        try:
            data = base64.b64decode(text, validate=True)
        except ValueError:
            data = b""
        # The judgement's time counts against the notebook's, like its cells': a record slow to read buys nothing.
        began = time.monotonic()
        try:
            result = self.judge(ex_id, data, seed, max(1.0, min(2 * self.registry[ex_id].timeout + 30,
                                                                self.limits.timeout - self.spent)))
        except JudgeFailed as exc:
            result = {"status": INTERFERED, "message": str(exc), "crashed": False}
        finally:
            self.spent += time.monotonic() - began
        if result["status"] == INTERFERED:
            return Outcome(NOT_RUN, f"no result: the record of what the answer produced does not match the checker "
                                    f"({result['message']}); the notebook's code interfered with the grader's check",
                           self.result.name, ["interfered with the record of the grader's check"])
        if result["status"] not in (CORRECT, INCORRECT, NOT_ATTEMPTED):
            return Outcome(NOT_RUN, "no result: the grader's judgement gave none", self.result.name)
        if result["crashed"]:
            return Outcome(NOT_RUN, f"no result: the course's checker failed on this answer ({result['message']}); "
                                    "please report it to the course", self.result.name)
        return Outcome(result["status"], str(result["message"]), self.result.name)


def _maybe_starved(result: NotebookRun) -> bool:
    """A run that other notebooks beside it could have starved of CPU: out of time, its kernel or its judging
    process not started in time."""
    return (result.status in ("time limit", "could not run")
            or any("did not start" in o.message for o in result.outcomes.values()))


def grade(submissions, limits: Limits | None = None, jobs: int = 1, progress=None,
          unsafe_no_sandbox: bool = False) -> ClassReport:
    """Grade every learner's notebooks under `submissions`; return the ClassReport.

    Without the namespaces that keep learners apart (mount, network, PID) it refuses (GradeError), unless
    `unsafe_no_sandbox` (a class whose code is trusted)."""
    limits = limits or Limits()
    root = Path(submissions)
    learners = find_submissions(root)
    registry = dict(exercises.load_all())
    sandbox = Sandbox.probe()
    if not sandbox.complete and not unsafe_no_sandbox:
        raise GradeError("this machine cannot keep the learners' kernels apart (no mount, network and PID "
                         f"namespaces: {sandbox.why_not or 'only ' + ', '.join(sandbox.namespaces)}): a notebook "
                         "could read or change its classmates' work, reach the network or stop the grader. Grade on "
                         "Linux with `unshare` (as root, or with unprivileged user namespaces), or pass "
                         "--unsafe-no-sandbox for a class whose code you trust")
    # Hidden from every kernel (each has a /tmp of its own): the submissions, the grader's working directory and
    # temporary folder, the host's sockets under /run; a folder that holds Python or the course stays visible.
    hide = sorted({str(root.resolve()), os.path.realpath(os.getcwd()), os.path.realpath(tempfile.gettempdir()),
                   "/run"} - {"/", "/tmp"})
    # The submissions folder, and the grader's working directory unless it is a folder every program writes to.
    shared = {os.path.realpath(tempfile.gettempdir()), os.path.realpath(os.path.expanduser("~")), "/"}
    guarded = {str(root.resolve()): None}
    if os.path.realpath(os.getcwd()) not in shared:
        guarded[os.getcwd()] = None
    for key in guarded:
        guarded[key] = _fingerprint(key)
    tasks = [(learner, path) for learner, paths in learners.items() for path in paths]

    active: set[_Grading] = set()
    judges, local = [], threading.local()  # a judging process per grading thread, started once

    def one(task, alone=False):
        learner, path = task
        inside = path.relative_to(root)  # the learner's own folder (its name may not be the learner's) left out
        name = notebook_name(str(inside if len(inside.parts) == 1 else inside.relative_to(inside.parts[0])))
        if not hasattr(local, "judge"):
            local.judge = Judge(limits.memory)
            judges.append(local.judge)
        grading = _Grading(learner, path, name, registry, limits, sandbox, hide, local.judge)
        active.add(grading)
        try:
            result = grading.run()
        finally:
            active.discard(grading)
        collided = learners.notes.get(learner, [])  # shown beside the notebook and flagged on each of its results
        result.notes[:0] = collided
        for outcome in result.outcomes.values():
            outcome.flags[:0] = collided
        for key, before in guarded.items():
            after = _fingerprint(key)
            changes = _changes(before, after)
            if changes:
                guarded[key] = after
                also = ", or by a notebook running at the same time" if jobs > 1 else ""
                result.alerts.append(f"files in {key} changed while it ran (by this notebook{also}, or by another "
                                     f"program): {', '.join(changes)}")
        if progress and not (_maybe_starved(result) and jobs > 1 and not alone):
            progress(result)
        return result

    runs: dict[str, list[NotebookRun]] = {learner: [] for learner in learners}
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        again = []
        for task, result in zip(tasks, pool.map(one, tasks)):
            if _maybe_starved(result) and jobs > 1:  # maybe starved by a notebook beside it: a second run, alone,
                again.append(task)                     # decides
            else:
                runs[result.learner].append(result)
        for task in again:
            result = one(task, alone=True)
            result.notes.append(f"ran out of time or could not start beside other notebooks (--jobs {jobs}): graded "
                                "again alone")
            runs[result.learner].append(result)
    except BaseException:  # Ctrl-C: stop every kernel now rather than after its notebook
        pool.shutdown(wait=False, cancel_futures=True)
        for grading in list(active):
            grading._kill()
        raise
    finally:
        pool.shutdown(wait=False)
        for judge in judges:
            judge.close()
    pool.shutdown()
    report = ClassReport(root, learners, runs, registry, limits, sandbox)
    report.guarded = list(guarded)
    return report
