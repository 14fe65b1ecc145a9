"""The grader's sandbox launcher on its own (no kernel, no torch: a few seconds): what a kernel sees of the machine.

The launcher (course_tools/grader/sandbox.py) is run as the grader runs it, with a small Python script in place of
the kernel; the script reports what it can see and do. tests/test_grader.py grades hostile notebooks end to end.
"""
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from course_tools import grader
from course_tools.grader.run import NEEDED

SANDBOX = grader.Sandbox.probe()
pytestmark = pytest.mark.skipif(not SANDBOX.complete, reason="needs mount, network and PID namespaces")

PROBE = r'''
import json, os, sys
hidden = sys.argv[1]
seen = {"uid": os.getuid(), "hidden": os.listdir(hidden), "tmp": sorted(os.listdir("/tmp")),
        "shm": os.listdir("/dev/shm"), "cwd": os.getcwd()}
for name, path in (("hidden", hidden), ("shm", "/dev/shm"), ("work", os.getcwd()), ("etc", "/etc")):
    try:
        with open(os.path.join(path, "probe.txt"), "w") as f:
            f.write("x")
        seen["wrote " + name] = True
    except OSError as exc:
        seen["wrote " + name] = exc.strerror
print(json.dumps(seen))
'''


@pytest.fixture
def outside_tmp():
    """A folder of the grader's outside /tmp (which the sandbox replaces as a whole) and outside the home folder
    (which it may replace too), with a file in it: a hidden folder next to the tests (pytest does not collect it)."""
    folder = Path(tempfile.mkdtemp(prefix=".course-grader-test-", dir=Path(__file__).parent))
    (folder / "classmate.txt").write_text("a classmate's work")
    yield folder
    shutil.rmtree(folder)


def _launch(base: Path, hide: list[str]) -> tuple[dict, dict]:
    """Run PROBE through the launcher as the grader would; (what it saw, the launcher's status)."""
    ipc, work = base / "ipc", base / "work"
    ipc.mkdir()
    work.mkdir()
    (ipc / "kernel.json").write_text("{}")
    config = {"work": str(work), "ipc": str(ipc), "lock": str(ipc / "grader.lock"), "log": str(ipc / "kernel.log"),
              "status": str(ipc / "sandbox.json"), "connection": str(ipc / "kernel.json"), "protect_fs": True,
              "disk": 2 ** 26, "rlimits": {"NPROC": 50}, "env": {"PATH": os.environ.get("PATH", "")},
              "hide": hide, "needed": NEEDED, "uid": 2_000_000_000 + os.getpid()}
    (ipc / "config.json").write_text(json.dumps(config))
    with open(ipc / "grader.lock", "w") as lock:  # held: the launcher stops the kernel once the grader is gone
        fcntl.flock(lock, fcntl.LOCK_EX)
        run = subprocess.run(SANDBOX.command(str(ipc / "config.json"),
                                             [sys.executable, "-I", "-c", PROBE, hide[0]]),
                             capture_output=True, text=True, timeout=120)
    log = (ipc / "kernel.log").read_text()
    assert run.returncode == 0, run.stderr + log
    return json.loads(log.strip().splitlines()[-1]), json.loads((ipc / "sandbox.json").read_text())


def test_a_kernel_sees_an_empty_read_only_folder_in_place_of_a_hidden_one(outside_tmp):
    base = Path(tempfile.mkdtemp(prefix="course-grade-", dir="/tmp"))
    try:
        seen, status = _launch(base, [str(outside_tmp)])
    finally:
        shutil.rmtree(base)
    assert "private folders" in status["applied"] and "filesystem" in status["applied"], status
    assert seen["hidden"] == [] and seen["wrote hidden"] == "Read-only file system"
    assert seen["wrote etc"] != True  # noqa: E712  (read-only, or not its own)
    assert seen["wrote work"] is True and seen["wrote shm"] is True  # its own, private folders
    # /tmp is a tmpfs of its own: its own folders, nothing of the machine's or of other kernels'
    assert seen["tmp"] == sorted([".dev-shm", ".var-tmp", base.name])
    assert os.listdir(outside_tmp) == ["classmate.txt"] and not Path("/dev/shm/probe.txt").exists()
    if "own uid" in status["applied"]:
        assert seen["uid"] == status["uid"] != 0
