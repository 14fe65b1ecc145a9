"""The sandbox: what this machine allows (`Sandbox.probe`, by trying `unshare`) and the launcher that runs inside it.

The launcher is this file run as a script, `python -I -S sandbox.py --sandbox CONFIG -- KERNEL...`, between
`unshare` and the kernel: in the new namespaces (as their PID 1) it gives the kernel a /tmp of its own (a tmpfs of
`disk` bytes that holds its working directory, also bound on /var/tmp and /dev/shm), hides the folders in
`hide` (the submissions, the grader's temporary folder, /run: empty read-only tmpfs mounts) unless they hold what
the kernel needs, makes everything else read-only, sets the resource limits, and starts the kernel without
capabilities, under a uid of its own where it runs as the real root (then RLIMIT_NPROC counts the kernel's
processes alone). It stops the kernel when the grader is gone. Only the standard library, and nothing of this
package, is imported here.
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

    @property
    def complete(self) -> bool:
        """Mount, network and PID namespaces: what the grader needs to keep learners apart."""
        return {"mount", "net", "pid"} <= set(self.namespaces)

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
        # --ipc: SysV shared memory and message queues and POSIX message queues of its own, gone with the kernel
        tries = [(["--mount", "--net", "--pid", "--ipc", "--fork", "--kill-child", "--mount-proc"],
                  ["mount", "net", "pid", "ipc"]),
                 (["--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"], ["mount", "net", "pid"]),
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
    uid = config.get("uid") if _real_root() else None
    if config.get("protect_fs"):
        try:
            visible = _private_folders(config["work"], config["ipc"], config.get("disk"), config.get("hide", []),
                                       config.get("needed", []), uid)
            applied.append("private folders")
            if visible:
                missing.append(["private folders (partly)", "left visible: " + ", ".join(visible)])
            keep = {config["work"], config["ipc"]} | (set() if "/tmp" in visible else {"/tmp", "/var/tmp"})
            left = _read_only(keep)
            applied.append("filesystem")
            if left:
                missing.append(["filesystem (partly)", "left writable: " + ", ".join(left)])
        except Exception as exc:  # reported; the audit hook still guards Python-level writes
            missing.append(["filesystem", str(exc)])
    if not config.get("protect_fs") or "filesystem" not in applied:
        os.makedirs(config["work"], exist_ok=True)
    os.makedirs(os.path.join(config["work"], "tmp"), exist_ok=True)
    if uid is not None and not _can_run_as(uid, config.get("needed", [])):
        missing.append(["own uid", "Python or the course is not readable by another user: the kernel runs as root "
                                   "without capabilities, and RLIMIT_NPROC does not bind root"])
        uid = None
    if uid is not None:
        for path in (config["work"], os.path.join(config["work"], "tmp"), config["ipc"], config["connection"]):
            os.chown(path, uid, uid)  # the kernel works there, writes its sockets there, reads its key there
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
    if uid is not None:
        applied.append("own uid")
    elif caps and not any(m[0] == "own uid" for m in missing):
        missing.append(["own uid", "the launcher is root only inside a user namespace: one uid is mapped"])
    with open(config["status"], "w") as f:
        json.dump({"applied": applied, "missing": missing, "pid1": os.getpid() == 1, "caps_dropped": caps,
                   "uid": uid, "nproc_binds": uid is not None or not _real_root()}, f)
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
                _drop_capabilities(uid)
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


def _mount(*args: str) -> None:
    import subprocess
    run = subprocess.run(["mount", *args], capture_output=True, text=True)
    if run.returncode:
        raise OSError(f"mount {' '.join(args)}: {run.stderr.strip() or run.returncode}")


def _bind_fd(fd: int, target: str) -> None:
    """Bind the folder open as `fd` on `target` (mount(8) would resolve /proc/self/fd/N to a path, now hidden)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    MS_BIND, MS_REC = 4096, 16384
    if libc.mount(f"/proc/self/fd/{fd}".encode(), target.encode(), None, MS_BIND | MS_REC, None) != 0:
        raise OSError(ctypes.get_errno(), f"bind mount on {target}: {os.strerror(ctypes.get_errno())}")


def _private_folders(work: str, ipc: str, disk: int | None, hide: list[str], needed: list[str],
                     uid: int | None) -> list[str]:
    """In a new mount namespace: a private /tmp (a tmpfs of `disk` bytes, also on /var/tmp and /dev/shm) that holds
    `work` and, bound from the grader's, `ipc`; an empty read-only tmpfs on each folder of `hide`. A folder that
    holds one of `needed` (Python, the course) stays visible: returned."""
    def holds_needed(point):
        return any(n == point or n.startswith(point.rstrip("/") + "/") for n in needed)

    _mount("--make-rprivate", "/")
    ipc_fd = os.open(ipc, os.O_PATH | os.O_DIRECTORY)
    visible = []
    size = f"size={int(disk)}," if disk else ""
    if holds_needed("/tmp") or not os.path.isdir("/tmp"):
        visible.append("/tmp")
        os.makedirs(work, exist_ok=True)
        _mount("-t", "tmpfs", "-o", f"{size}mode=0700", "tmpfs", work)
    else:
        _mount("-t", "tmpfs", "-o", f"{size}mode=1777", "tmpfs", "/tmp")
        for point, inside in (("/var/tmp", "/tmp/.var-tmp"), ("/dev/shm", "/tmp/.dev-shm")):
            os.makedirs(inside)
            os.chmod(inside, 0o1777)
            if os.path.isdir(point) and not os.path.islink(point):
                _mount("--bind", inside, point)
        os.makedirs(work, exist_ok=True)
    for point in hide:
        if point in ("/", "/tmp") or os.path.islink(point) or not os.path.isdir(point):
            continue  # a link (/var/run) is hidden with what it points to; a folder under /tmp is gone already
        if holds_needed(point):
            visible.append(point)
            continue
        _mount("-t", "tmpfs", "-o", "size=4k,mode=0755", "tmpfs", point)
    os.makedirs(ipc, exist_ok=True)
    _bind_fd(ipc_fd, ipc)
    os.close(ipc_fd)
    if uid is not None:
        _open_the_way(needed)
    os.chmod(work, 0o700)
    return visible


def _open_the_way(needed: list[str]) -> None:
    """A kernel with a uid of its own must reach `needed` (Python may live under /root, 0700): each folder on the
    way that other users cannot enter becomes an empty tmpfs (0755) with only the needed folders bound back in."""
    blocked = {}
    for path in needed:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            folder = "/" + "/".join(parts[:i])
            if folder in blocked or not os.stat(folder).st_mode & 0o001:
                blocked.setdefault(folder, []).append(path)
                break
    for folder, paths in blocked.items():
        fds = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in paths if os.path.isdir(path)}
        _mount("-t", "tmpfs", "-o", "size=4k,mode=0755", "tmpfs", folder)
        for path, fd in fds.items():
            os.makedirs(path, exist_ok=True)
            _bind_fd(fd, path)
            os.close(fd)


def _can_run_as(uid: int, needed: list[str]) -> bool:
    """Whether `uid` may read and enter each of `needed` (tried in a child that takes the uid)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os._exit(0 if all(os.access(p, os.R_OK | os.X_OK) for p in needed) else 1)
        except BaseException:
            os._exit(2)
    return os.waitpid(pid, 0)[1] == 0


def _read_only(keep: set[str]) -> list[str]:
    """Remount every mount point read-only except `keep` (and /proc, /sys, /dev); returns those that stay writable
    (the root one raises)."""
    keep = {os.path.realpath(p) for p in keep}
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].encode().decode("unicode_escape") for line in f]
    left = []
    for point in dict.fromkeys(points):
        if point in keep or point.split("/")[1] in ("proc", "sys", "dev"):
            continue
        try:
            _mount("-o", "remount,bind,ro", point)
        except OSError:
            if point == "/":
                raise
            left.append(point)  # the audit hook still guards it
    return left


def _real_root() -> bool:
    """Root of the machine (not only of a user namespace): it may give the kernel a uid of its own."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/self/uid_map") as f:
            first = f.read().split()
        return first[:3] == ["0", "0", "4294967295"]
    except OSError:
        return False


def _drop_capabilities(uid: int | None) -> None:
    """Empty the capability bounding set, take `uid` (if given) and forbid gaining privileges: root in the namespace
    becomes powerless."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 24, 38
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--sandbox":
    sys.exit(_sandbox_main(sys.argv[2:]))
