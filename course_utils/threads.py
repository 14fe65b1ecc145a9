"""CPU threads on a machine that is not yours alone (notebook 04).

- `cpu_use(seconds)`: how many CPUs' worth this process (with its DataLoader workers) and every other process
  used over the next `seconds`, read the way the live monitor reads it (`monitor.HostSource`).
- `BusyCores(n)`: `n` CPU-bound processes of someone else's (a browser tab, a video call, another kernel) for as long
  as a `with` block runs: what a learner's laptop is like.
- `wait_policy()`: how torch's OpenMP threads wait for work in this process, from `OMP_WAIT_POLICY`.
- `follow_load()`: in Jupyter, before each cell, torch's thread count follows the cores other processes leave free
  (every notebook's first cell calls it).

Why it matters: torch runs an operation's parallel regions on `torch.get_num_threads()` threads (one per core by
default), and a region ends only when its slowest thread is done. When another program holds one of the cores, the
thread on that core runs late; with OpenMP's default policy the threads that finished first spin on their cores
waiting for it (GNU OpenMP spins up to about 300,000 times before sleeping), taking CPU time from that program, which
then holds the core longer. With `OMP_WAIT_POLICY=PASSIVE` they sleep at once. OpenMP reads the variable once, when
torch loads it: set it before `import torch` (each notebook's first cell does).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

from .errors import first_line
from .i18n import _

__all__ = ["BusyCores", "CpuUse", "LoadFollower", "cpu_use", "follow_load", "following", "wait_policy"]

# A loop that holds one core; it exits by itself when the process that started it is gone (checked every 0.2 s) or
# after `seconds`, so a kernel restarted, or a cell interrupted while it starts one, leaves nothing running for long.
_SPIN = """
import sys, time
import psutil
parent, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while psutil.pid_exists(parent) and time.monotonic() < deadline:
    end = time.monotonic() + 0.2
    while time.monotonic() < end:
        pass
"""
# Started through a launcher that exits at once, so the loop is not this process's child: the monitor and
# `cpu_use` count it among the other processes, as they would a browser.
_LAUNCH = """
import subprocess, sys
p = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
print(p.pid, flush=True)
"""


@dataclass(frozen=True)
class CpuUse:
    """CPUs' worth used over a span: by this process and its children, and by every other process."""
    mine: float
    others: float
    cpus: float  # the CPUs this process may run on

    def __str__(self) -> str:
        return _("this process {mine:.1f} of {cpus:g} CPUs, other processes {others:.1f}").format(
            mine=self.mine, others=self.others, cpus=self.cpus)


def _since(source) -> CpuUse | None:
    """CPU use since `source` (a `monitor.HostSource`) last sampled, or was made; None if it could not be read (a
    container's usage file unreadable)."""
    host = source.sample()
    if host.cpu_percent is None:
        return None
    busy = host.cpu_percent / 100 * host.cpu_count
    mine = (host.kernel_cpu_percent or 0.0) / 100 * host.cpu_count
    return CpuUse(mine=mine, others=max(0.0, busy - mine), cpus=host.cpu_count)


def cpu_use(seconds: float = 0.5) -> CpuUse:
    """Measure for `seconds` (the call sleeps meanwhile) how busy the CPUs this process may use are, and how much of
    that is this process's own (with its children); all zero if the CPU use could not be read."""
    from .monitor.host import HostSource

    source = HostSource()  # its baseline: now
    time.sleep(seconds)
    return _since(source) or CpuUse(mine=0.0, others=0.0, cpus=source.sample().cpu_count)


def wait_policy() -> str:
    """'PASSIVE' (threads waiting for work sleep), 'ACTIVE' (they spin) or 'default' (they spin a while, then
    sleep), from OMP_WAIT_POLICY as this process sees it now; OpenMP read it when torch was imported."""
    value = os.environ.get("OMP_WAIT_POLICY", "").strip().upper()
    return value if value in ("PASSIVE", "ACTIVE") else "default"


class BusyCores:
    """`with BusyCores(1): ...` runs the block beside one CPU-bound process that is not this one's child.

    The processes start on entering and are killed on leaving; each also ends by itself after `seconds`, or when
    this process is gone, so an interrupt while they start leaves nothing busy for long.
    """

    def __init__(self, n: int = 1, seconds: float = 120.0):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(_("n must be a non-negative int, got {n!r}").format(n=n))
        self.n, self.seconds = n, seconds
        self.pids: list[int] = []

    def __enter__(self) -> "BusyCores":
        try:
            for _i in range(self.n):
                out = subprocess.run([sys.executable, "-c", _LAUNCH, _SPIN, str(os.getpid()), str(self.seconds)],
                                     capture_output=True, text=True, timeout=30, check=True)
                self.pids.append(int(out.stdout.split()[0]))
            time.sleep(0.05)  # running, not still starting
        except BaseException:  # an interrupt (Ctrl-C, a checker's deadline) while starting: stop what started
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        import psutil

        procs = []
        for pid in self.pids:
            try:
                proc = psutil.Process(pid)
                proc.kill()
                procs.append(proc)
            except psutil.Error:  # already gone
                pass
        self.pids = []
        deadline = time.monotonic() + 5
        for proc in procs:  # gone, or a zombie (not our child: its parent reaps it), before the block's next line
            while time.monotonic() < deadline:
                try:
                    if proc.status() == psutil.STATUS_ZOMBIE:
                        break
                except psutil.Error:
                    break
                time.sleep(0.01)


class LoadFollower:
    """Before each cell, sets torch's intra-op thread count to the cores that other processes left free over the
    last `window` seconds: `threads` (the count at the start, one per core by default) when the machine is quiet, one
    fewer for each core's worth of CPU time that other processes used (rounded: half a core counts), never under 1.
    With a CPU quota (a container), the quota's whole CPUs are the cores. The window keeps a moment's spike (a kernel
    shutting down, a tab loading) from changing the count; the time before the follower started counts as quiet.

    A decision takes a few psutil reads (about a millisecond; more on a machine with hundreds of processes), made
    only when at least `span` seconds have passed since the last one. This process's children (DataLoader workers,
    torchrun) count as its own. It runs on the kernel's main thread, where cells run: OpenMP keeps the thread count
    per calling thread. Once the count is not the one this follower set (the learner called `torch.set_num_threads`
    with another count), it stops and leaves the count alone; `stop()` stops it in any case (a count equal to the
    follower's cannot be told from it). If a reading fails, it prints one line and stops. `changes` lists the
    decisions that changed the count: (the cell's execution count, other processes' CPUs over the window, threads).
    """

    def __init__(self, span: float = 0.5, window: float = 2.0):
        import torch

        from .monitor.host import HostSource

        self._torch, self._source, self.span = torch, HostSource(), span
        self.threads = self.current = torch.get_num_threads()
        self.kind = "LoadFollower"  # how follow_load() finds it among the shell's callbacks, whatever module made it
        self._asked, self.window = time.monotonic(), window
        self._spans: list[tuple[float, float]] = []  # (seconds, CPU-seconds of other processes), newest last
        self.changes: list[tuple[int, float, int]] = []
        self.stopped = False

    def decide(self, use: CpuUse) -> int:
        """The thread count for a span with this CPU use."""
        held = int(use.others + 0.5)
        return max(1, min(self.threads, int(use.cpus + 1e-9) - held))

    def before_cell(self, *_info) -> None:
        """IPython's pre_run_cell event: never a traceback above the learner's cell."""
        try:
            self.update()
        except KeyboardInterrupt:  # a Ctrl-C meant for the cell, landing in this millisecond: no decision this time
            return
        except Exception as error:  # psutil or /proc failing: one line, once (no frame of a hook's is the
            self.stop()             # learner's), and the count stays as it is
            print(_("torch's thread count no longer follows the load ({error}); it stays at {threads}.").format(
                error=first_line(error), threads=self._torch.get_num_threads()), file=sys.stderr)

    def update(self) -> None:
        """Decide now (what happens before each cell), from the other processes' CPU use over the last window."""
        if self.stopped:
            return
        if self._torch.get_num_threads() != self.current:  # the learner chose a count: theirs from now on
            self.stop()
            return
        now = time.monotonic()
        if now - self._asked < self.span:
            return
        use, elapsed, self._asked = _since(self._source), now - self._asked, now
        if use is None:  # nothing could be read: no decision, rather than one as if the machine were quiet
            return
        self._spans.append((elapsed, use.others * elapsed))
        while len(self._spans) > 1 and sum(t for t, _o in self._spans[1:]) >= self.window:
            self._spans.pop(0)  # what is left still covers the window
        others, left = 0.0, self.window  # the last `window` seconds, the oldest span cut to fit; before: quiet
        for seconds, cpu_seconds in reversed(self._spans):
            part = min(seconds, left)
            if part > 0:
                others += cpu_seconds * part / seconds
            left -= part
        use = CpuUse(mine=use.mine, others=others / self.window, cpus=use.cpus)
        wanted = self.decide(use)
        if wanted != self.current:
            self._torch.set_num_threads(wanted)
            self.current = wanted
            shell = _shell()  # IPython counts a cell before it runs: this one's number is one less
            cell = getattr(shell, "execution_count", 1) - 1
            self.changes.append((cell, round(use.others, 2), wanted))

    def stop(self) -> None:
        """Stop following; the thread count stays as it is."""
        self.stopped = True
        shell = _shell()
        if shell is not None:
            try:
                shell.events.unregister("pre_run_cell", self.before_cell)
            except ValueError:  # not registered
                pass


def _shell():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


_follower: LoadFollower | None = None


def _registered(shell) -> list:
    """The followers registered with this shell that still follow, also ones made before this module was reloaded
    (`%autoreload`), whose class is another."""
    found = []
    for callback in list(shell.events.callbacks.get("pre_run_cell", [])):
        owner = getattr(callback, "__self__", None)
        if getattr(owner, "kind", None) == "LoadFollower" and not getattr(owner, "stopped", True):
            found.append(owner)
    return found


def follow_load(span: float = 0.5, window: float = 2.0) -> None:
    """In IPython or Jupyter: before each cell, torch's thread count follows the cores other processes left free over
    the last `window` seconds (a `LoadFollower`, which `following()` returns). Outside IPython it does nothing.
    Calling it again keeps the follower there is, or starts a new one if it had stopped."""
    global _follower
    shell = _shell()
    if shell is None:
        return
    running = _registered(shell)
    if running:  # one already follows (made by this module, or by it before a reload)
        _follower = running[0]
        return
    _follower = LoadFollower(span, window)
    shell.events.register("pre_run_cell", _follower.before_cell)


def following() -> LoadFollower | None:
    """The follower `follow_load()` started in this kernel, or None."""
    return _follower


# What notebook 04 compares: OpenMP's settings for a fresh process (None: unset) and the thread counts timed in it.
SETTINGS = {
    "OpenMP's default": {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": None},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000", "OMP_WAIT_POLICY": None},
    "OMP_WAIT_POLICY=PASSIVE": {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": "PASSIVE"},
}


def step_ms_in_fresh_process(setting: str, threads=(2,), steps: int = 10) -> dict:
    """{"quiet": {threads: ms}, "busy": {threads: ms}}: the median SimpleCNN training step (batch 64) in a new Python
    process started with one of `SETTINGS`, alone and beside one busy core (`course_utils.examples.thread_step`). A
    new process, because OpenMP reads its settings once, when torch is imported."""
    import json

    env = dict(os.environ)
    for name, value in SETTINGS[setting].items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    cmd = [sys.executable, "-m", "course_utils.examples.thread_step", "--steps", str(steps),
           "--threads", *map(str, threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(_("{command} failed:\n{stderr}").format(command=" ".join(cmd), stderr=out.stderr[-2000:]))
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {where: {int(n): ms for n, ms in figures.items()} for where, figures in result.items()}
