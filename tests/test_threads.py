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
