"""The sandbox: what this machine allows (`Sandbox.probe`, by trying `unshare`) and the launcher that runs inside it.

The launcher is this file run as a script, `python -I -S sandbox.py --sandbox CONFIG -- KERNEL...`, between
`unshare` and the kernel: in the new namespaces (as their PID 1) it makes the file system read-only, sets the
resource limits, starts the kernel without capabilities and stops it when the grader is gone. Only the standard
library, and nothing of this package, is imported here.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

_LINUX = sys.platform.startswith("linux")


class Sandbox:
    """What this machine allows: found once per grading run by trying `unshare`."""

    def __init__(self, prefix: list[str], namespaces: list[str], why_not: str):
        self.prefix, self.namespaces, self.why_not = prefix, namespaces, why_not

    def command(self, config: str, kernel: list[str]) -> list[str]:
        """The kernel's command line: the namespaces' prefix (`unshare ...`), this file as the launcher, the kernel."""
        return [*self.prefix, sys.executable, "-I", "-S", os.path.abspath(__file__), "--sandbox", config, "--", *kernel]

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


def _sandbox_main(argv: list[str]) -> int:
    """`sandbox.py --sandbox CONFIG -- KERNEL_CMD...`: apply what the config asks, fork the kernel, wait for it."""
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
