"""course_utils.threads: a busy core that is someone else's, and the CPU use of this process against all others,
checked against psutil's own per-process counters."""
import time

import psutil
import pytest

from course_utils.environment import cpu_load_line
from course_utils.threads import BusyCores, CpuUse, cpu_use, wait_policy


def test_busy_cores_run_outside_this_process_tree_and_stop_on_exit():
    me = psutil.Process()
    with BusyCores(1) as busy:
        assert len(busy.pids) == 1
        spinner = psutil.Process(busy.pids[0])
        assert spinner.pid not in {p.pid for p in me.children(recursive=True)}  # not our child: "someone else's"
        before = sum(spinner.cpu_times()[:2])
        time.sleep(0.5)
        used = sum(spinner.cpu_times()[:2]) - before
        assert used > 0.3, f"the busy core used only {used:.2f} CPU seconds in 0.5 s"
    assert not psutil.pid_exists(spinner.pid) or spinner.status() == psutil.STATUS_ZOMBIE


def test_cpu_use_tells_this_processs_work_from_other_processes():
    with BusyCores(1):
        others = cpu_use(0.6)
    assert others.others > 0.6 and others.mine < 0.3, others  # a whole core of someone else's
    # now this process is the busy one (and no one else's core): a busy loop in this thread while sampling
    import threading

    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin)
    t.start()
    try:
        mine = cpu_use(0.6)
    finally:
        stop.set()
        t.join()
    assert mine.mine > 0.6, mine


def test_busy_cores_refuse_a_bad_count():
    with pytest.raises(ValueError):
        BusyCores(-1)
    with BusyCores(0) as none:
        assert none.pids == []


def test_the_setup_check_says_whether_the_machine_is_busy():
    assert cpu_load_line(CpuUse(mine=0.1, others=1.2, cpus=2)).startswith("Busy machine: other processes are using 1.2")
    assert "quiet machine" in cpu_load_line(CpuUse(mine=1.0, others=0.2, cpus=2))


def test_wait_policy_reads_the_environment(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert wait_policy() == "PASSIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert wait_policy() == "default"


def test_the_follower_takes_one_thread_per_core_others_hold():
    from course_utils.threads import LoadFollower

    follower = LoadFollower.__new__(LoadFollower)  # decide() alone: no shell, no sampling
    follower.threads = 2
    assert follower.decide(CpuUse(mine=1.9, others=0.2, cpus=2)) == 2  # the server, the browser at rest
    assert follower.decide(CpuUse(mine=1.0, others=0.5, cpus=2)) == 1  # half a core held counts as held
    assert follower.decide(CpuUse(mine=0.6, others=0.67, cpus=2)) == 1  # a busy loop beside two spinning threads
    assert follower.decide(CpuUse(mine=0.2, others=3.0, cpus=2)) == 1  # never under one
    follower.threads = 6  # OMP_NUM_THREADS=6 on 8 cores: never more than the count it started with
    assert follower.decide(CpuUse(mine=0.0, others=0.0, cpus=8)) == 6
    assert follower.decide(CpuUse(mine=0.0, others=3.2, cpus=8)) == 5
    assert follower.decide(CpuUse(mine=0.0, others=1.0, cpus=1.5)) == 1  # a CPU quota of 1.5


def _skip_if_busy():
    """The follower's quiet decisions need a quiet machine: skip (saying why) when other processes already hold
    a good part of a core."""
    use = cpu_use(1.0)
    if use.others >= 0.3:
        pytest.skip(f"other processes use {use.others:.1f} CPUs: the follower would rightly take fewer threads")


_KERNEL = """
import json
from IPython.core.interactiveshell import InteractiveShell
import torch
torch.set_num_threads(2)
shell, seen = InteractiveShell.instance(), {}
for name, cell in [
    ("start", "import time, torch\\nfrom course_utils.threads import BusyCores, follow_load, following\\nfollow_load()"),
    ("quiet", "time.sleep(2.0)"),
    ("busy", "busy = BusyCores(1).__enter__()\\ntime.sleep(2.0)"),
    ("during", "busy.__exit__()\\ntime.sleep(2.0)"),
    ("back", "torch.set_num_threads(1)  # the learner's choice\\ntime.sleep(2.0)"),
    ("kept", "time.sleep(2.0)"),
]:
    shell.run_cell(cell, store_history=True)  # as Jupyter runs a cell: it has an execution count
    seen[name] = torch.get_num_threads() if name != "back" else shell.user_ns["following"]().current
seen["changes"] = shell.user_ns["following"]().changes
print(json.dumps(seen))
"""


@pytest.mark.skipif(len(psutil.Process().cpu_affinity() or [0]) < 2, reason="needs two cores")
def _in_a_shell(script: str):
    """Run `script` (it drives a real IPython shell, then prints a JSON line) in a fresh process, on a quiet machine:
    the process's output, and what it printed last."""
    import json
    import subprocess
    import sys

    _skip_if_busy()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out, json.loads(out.stdout.strip().splitlines()[-1])


def test_in_a_real_ipython_shell_the_threads_follow_a_busy_core_and_then_the_learner():
    _out, seen = _in_a_shell(_KERNEL)
    # what a cell ran with is what the follower decided before it, from the cells before it
    assert seen["quiet"] == 2 and seen["busy"] == 2, seen  # nothing held a core yet
    assert seen["during"] == 1, seen  # the cell after two seconds with one core held by another process
    assert seen["back"] == 2, seen  # two quiet seconds later, both threads again (then the learner set 1)
    assert seen["kept"] == 1, seen  # two quiet seconds after the learner's choice: still theirs
    assert [threads for _cell, _others, threads in seen["changes"]] == [1, 2], seen
    assert [cell for cell, _others, _threads in seen["changes"]] == [4, 5], seen  # the cells' execution counts


_EDGES = """
import importlib, json, sys
from IPython.core.interactiveshell import InteractiveShell
import torch
torch.set_num_threads(2)
shell, seen = InteractiveShell.instance(), {}
def cell(code):
    shell.run_cell(code, store_history=True)
cell("import time, torch\\nfrom torch.utils.data import DataLoader, Dataset\\n"
     "import course_utils.threads as threads\\nthreads.follow_load()")
# a DataLoader epoch whose two workers do a second of CPU work each, then end: this kernel's work, not another's
cell("class Slow(Dataset):\\n"
     "    def __len__(self): return 8\\n"
     "    def __getitem__(self, i):\\n"
     "        t = time.process_time()\\n"
     "        while time.process_time() - t < 0.25: pass\\n"
     "        return torch.zeros(4)\\n"
     "for batch in DataLoader(Slow(), batch_size=2, num_workers=2): pass")
cell("pass")
seen["after_workers"] = torch.get_num_threads()
seen["changes"] = shell.user_ns["threads"].following().changes
# %autoreload reloads the module: running the first cell again must not register a second follower
cell("importlib = __import__('importlib'); threads = importlib.reload(threads); threads.follow_load()")
seen["callbacks"] = sum(getattr(getattr(cb, "__self__", None), "kind", None) == "LoadFollower"
                        for cb in shell.events.callbacks["pre_run_cell"])
follower = shell.user_ns["threads"].following()
seen["found_again"] = follower is not None and not follower.stopped
# a reading that fails: one line, once, then the count is left alone
cell("def broken():\\n    raise OSError(5, 'Input/output error')\\nthreads.following()._source.sample = broken\\n"
     "time.sleep(0.6)")
for _ in range(3):
    cell("time.sleep(0.6)")
seen["stopped"] = shell.user_ns["threads"].following().stopped
print(json.dumps(seen))
"""


@pytest.mark.skipif(len(psutil.Process().cpu_affinity() or [0]) < 2, reason="needs two cores")
def test_the_follower_counts_its_workers_as_its_own_survives_a_reload_and_a_failed_reading():
    out, seen = _in_a_shell(_EDGES)
    assert seen["after_workers"] == 2 and seen["changes"] == [], seen  # the workers' 2 CPU-seconds were ours
    assert seen["callbacks"] == 1 and seen["found_again"], seen
    assert seen["stopped"], seen
    said = [line for line in (out.stdout + out.stderr).splitlines() if "no longer follows the load" in line]
    assert len(said) == 1 and "OSError" in said[0], out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr, out.stdout + out.stderr


class _Host:
    """What `HostSource.sample()` gives the follower: the machine's busy share (from `others`, on 2 CPUs), this
    process's own none; None when unreadable; a Ctrl-C landing in the reading when `interrupt`."""
    others, interrupt, unreadable = 0.0, False, False

    def sample(self):
        from types import SimpleNamespace

        if self.interrupt:
            raise KeyboardInterrupt
        percent = None if self.unreadable else self.others / 2 * 100
        return SimpleNamespace(cpu_percent=percent, cpu_count=2, kernel_cpu_percent=0.0)


class _Torch:
    """torch's thread count, without changing this test process's."""
    n = 2

    def get_num_threads(self):
        return self.n

    def set_num_threads(self, n):
        self.n = n


def _fake_follower():
    from course_utils.threads import LoadFollower

    follower = LoadFollower()
    follower._source, follower._torch, follower.threads, follower.current = _Host(), _Torch(), 2, 2
    return follower


def test_the_follower_decides_over_the_last_two_seconds_so_a_spike_changes_nothing():
    follower = _fake_follower()

    def span(seconds, others):
        follower._source.others = others
        follower._asked = time.monotonic() - seconds  # as if `seconds` had passed since the last decision
        follower.update()
        return follower._torch.n

    assert span(0.6, 0.9) == 2  # a kernel shutting down for half a second: 0.27 of a core over the window
    assert span(2.0, 1.0) == 1  # another program on one core for two seconds
    assert span(0.9, 0.0) == 1  # more than half of the window still busy: half a core counts
    assert span(1.2, 0.0) == 2  # two quiet seconds
    assert span(0.2, 1.0) == 2  # under `span` seconds since the last decision: no decision
    assert [threads for _cell, _others, threads in follower.changes] == [1, 2]


def test_the_follower_makes_no_decision_from_a_reading_it_could_not_take():
    follower = _fake_follower()
    follower._source.others = 2.0
    follower._asked = time.monotonic() - 3
    follower.before_cell()
    assert follower._torch.n == 1  # both cores busy with others' work
    follower._source.unreadable = True  # a container's usage file unreadable: not a quiet machine, no reading at all
    follower._asked = time.monotonic() - 3
    follower.before_cell()
    assert follower._torch.n == 1 and not follower.stopped
    follower._source.interrupt = True
    follower._asked = time.monotonic() - 3
    follower.before_cell()  # nothing raised, nothing printed: the decision is skipped
    assert follower._torch.n == 1 and not follower.stopped


def test_children_that_ended_stay_this_processs_own():
    """A DataLoader epoch's workers end before the next reading: their CPU time is this process's, not another
    program's (what the follower and the monitor tell apart). Counted in CPU-seconds, so other load does not matter."""
    import subprocess
    import sys

    from course_utils.monitor.host import HostSource

    source, start = HostSource(), time.monotonic()
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                    "while time.process_time() - t < 0.5:\n    pass"], check=True, timeout=60)
    host, wall = source.sample(), time.monotonic() - start
    mine = host.kernel_cpu_percent / 100 * host.cpu_count * wall
    assert mine > 0.45, f"the ended child's 0.5 CPU-seconds counted as {mine:.2f}"
