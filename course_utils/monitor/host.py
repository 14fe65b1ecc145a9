"""CPU and RAM through psutil, measured against container limits when there are any.

In a container `psutil.virtual_memory()` and `psutil.cpu_percent()` describe the *host*: 256 GiB of
RAM and 64 idle CPUs say nothing about a notebook limited to 8 GiB and 2 CPUs. So we find this
process's cgroup (v2 `memory.max`/`cpu.max`, or v1 `memory.limit_in_bytes`/`cpu.cfs_quota_us`) and,
when it sets a limit, report usage against that limit instead.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from .stats import HostStats

_UNLIMITED_V1 = 2 ** 62  # v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX pages)


def _read(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_int(path: Path | None) -> int | None:
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _stat_value(path: Path, key: str) -> int | None:
    """A value from a `key value` per line file (memory.stat, cpu.stat)."""
    text = _read(path)
    if text is None:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return None
    return None


@dataclass
class CgroupLimits:
    """Where this process's cgroup files are; limits and usage are re-read on every call (cheap).

    `memory_dirs`/`cpu_dirs` list the process's own cgroup directory first, then its ancestors up to
    the mount point: a limit set on a parent (a Kubernetes pod) applies too, so the smallest counts.
    """
    memory_version: int | None = None   # 1, 2, or None when no memory cgroup was found
    cpu_version: int | None = None
    memory_dirs: list[Path] = field(default_factory=list)
    cpu_dirs: list[Path] = field(default_factory=list)
    cpuacct_dir: Path | None = None     # v1 only: where cpuacct.usage lives

    def memory_limit(self) -> int | None:
        """Bytes, or None when no cgroup sets a memory limit."""
        name = "memory.max" if self.memory_version == 2 else "memory.limit_in_bytes"
        limits = [v for v in (_read_int(d / name) for d in self.memory_dirs)
                  if v is not None and v < _UNLIMITED_V1]  # v2 writes "max", which _read_int gives as None
        return min(limits) if limits else None

    def memory_used(self) -> int | None:
        """Bytes charged to this cgroup minus reclaimable file cache (what `docker stats` shows)."""
        if not self.memory_dirs:
            return None
        own = self.memory_dirs[0]
        if self.memory_version == 2:
            usage, inactive = _read_int(own / "memory.current"), _stat_value(own / "memory.stat", "inactive_file")
        else:
            usage = _read_int(own / "memory.usage_in_bytes")
            inactive = _stat_value(own / "memory.stat", "total_inactive_file")
        if usage is None:
            return None
        return max(0, usage - (inactive or 0))

    def cpu_quota(self) -> float | None:
        """CPUs allowed by a CFS quota (e.g. 1.5), or None when unlimited."""
        quotas = []
        for d in self.cpu_dirs:
            if self.cpu_version == 2:
                parts = (_read(d / "cpu.max") or "").split()
                if len(parts) == 2 and parts[0] != "max":
                    quota, period = int(parts[0]), int(parts[1])
                else:
                    continue
            else:
                quota, period = _read_int(d / "cpu.cfs_quota_us"), _read_int(d / "cpu.cfs_period_us")
                if quota is None or period is None or quota < 0:
                    continue
            if period > 0:
                quotas.append(quota / period)
        return min(quotas) if quotas else None

    def cpu_usage_seconds(self) -> float | None:
        """CPU time used by this cgroup so far, in seconds."""
        if self.cpu_version == 2 and self.cpu_dirs:
            usec = _stat_value(self.cpu_dirs[0] / "cpu.stat", "usage_usec")
            return usec / 1e6 if usec is not None else None
        nsec = _read_int(self.cpuacct_dir / "cpuacct.usage") if self.cpuacct_dir else None
        return nsec / 1e9 if nsec is not None else None


def _unescape(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _chain(mount: str, root: str, cgroup_path: str) -> list[Path]:
    """The process's cgroup directory under `mount`, then its parents up to `mount`."""
    rel = cgroup_path[len(root):] if root != "/" and cgroup_path.startswith(root) else cgroup_path
    base = Path(mount)
    own = base / rel.lstrip("/")
    if not own.is_dir():  # cgroup namespace / unusual mount: the mount point is our cgroup
        own = base
    dirs = [own]
    while dirs[-1] != base and base in dirs[-1].parents:
        dirs.append(dirs[-1].parent)
    return dirs


def read_cgroup_limits(proc: str | os.PathLike = "/proc") -> CgroupLimits:
    """Locate this process's cgroups from `<proc>/self/cgroup` and `<proc>/self/mountinfo`.

    Never raises: a machine without cgroups (macOS, Windows) gives an empty CgroupLimits.
    """
    proc = Path(proc)
    limits = CgroupLimits()
    mountinfo, cgroups = _read(proc / "self" / "mountinfo"), _read(proc / "self" / "cgroup")
    if mountinfo is None or cgroups is None:
        return limits
    v1_mounts: dict[str, tuple[str, str]] = {}  # controller -> (root, mount point)
    v2_mount = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 4 or len(fields) < 5:
            continue
        root, mount, fstype, options = _unescape(fields[3]), _unescape(fields[4]), fields[sep + 1], fields[sep + 3]
        if fstype == "cgroup2" and v2_mount is None:
            v2_mount = (root, mount)
        elif fstype == "cgroup":
            for opt in options.split(","):
                if opt in ("memory", "cpu", "cpuacct"):
                    v1_mounts.setdefault(opt, (root, mount))
    v1_paths: dict[str, str] = {}
    v2_path = None
    for line in cgroups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            v2_path = path
        for c in controllers.split(","):
            v1_paths[c] = path
    # A controller is attached to one hierarchy: v1 when it is mounted there, else the unified (v2) one.
    if "memory" in v1_mounts and "memory" in v1_paths:
        limits.memory_version, limits.memory_dirs = 1, _chain(v1_mounts["memory"][1], v1_mounts["memory"][0],
                                                               v1_paths["memory"])
    elif v2_mount is not None and v2_path is not None:
        dirs = _chain(v2_mount[1], v2_mount[0], v2_path)
        if (dirs[0] / "memory.current").exists():
            limits.memory_version, limits.memory_dirs = 2, dirs
    if "cpu" in v1_mounts and "cpu" in v1_paths:
        limits.cpu_version, limits.cpu_dirs = 1, _chain(v1_mounts["cpu"][1], v1_mounts["cpu"][0], v1_paths["cpu"])
        if "cpuacct" in v1_mounts and "cpuacct" in v1_paths:
            limits.cpuacct_dir = _chain(v1_mounts["cpuacct"][1], v1_mounts["cpuacct"][0], v1_paths["cpuacct"])[0]
    elif v2_mount is not None and v2_path is not None:
        dirs = _chain(v2_mount[1], v2_mount[0], v2_path)
        if (dirs[0] / "cpu.stat").exists():
            limits.cpu_version, limits.cpu_dirs = 2, dirs
    return limits


def _busy_percent(before, after) -> float:
    """Busy share of one CPU between two psutil.cpu_times() readings, computed as psutil.cpu_percent does."""
    def busy_total(t):
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)  # guest time is in user too
        return total - t.idle - getattr(t, "iowait", 0.0), total  # waiting for I/O counts as idle

    busy0, total0 = busy_total(before)
    busy1, total1 = busy_total(after)
    if total1 - total0 <= 0:
        return 0.0
    return min(100.0, max(0.0, 100.0 * (busy1 - busy0) / (total1 - total0)))


class HostSource:
    """Samples CPU busy percent (and how much of it is this kernel's own, with its DataLoader workers), RAM
    used/total and this process's resident memory.

    CPU: with a container CPU quota, the cgroup's CPU time over wall time, as a share of the quota;
    otherwise the per-CPU busy share since the previous sample, averaged over the CPUs this process may
    run on. A first reading needs a baseline: psutil.cpu_percent() returns 0.0 on its first call, and
    since psutil 6 it keeps that baseline per calling thread, so priming it here would not prime the
    monitor thread. So the source keeps its own baseline of psutil.cpu_times(percpu=True), taken in the
    constructor, and computes the same busy share psutil would; any thread may sample.
    RAM: against the cgroup memory limit when one is set below the machine's RAM.
    """

    def __init__(self, cgroup: CgroupLimits | None = None, proc: str | os.PathLike = "/proc"):
        import psutil

        self.reason: str | None = None
        self._psutil = psutil
        self._cgroup = read_cgroup_limits(proc) if cgroup is None else cgroup
        self._process = psutil.Process()
        host_cpus = psutil.cpu_count() or os.cpu_count() or 1
        try:
            self._cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not on Linux
            self._cpus = list(range(host_cpus))
        self._cpu_times = psutil.cpu_times(percpu=True)  # the baseline ("priming")
        self._cpu_asked = time.monotonic()
        self._last = (time.monotonic(), self._cgroup.cpu_usage_seconds())
        self._last_percent: float | None = None
        self._kernel_times = (time.monotonic(), self._kernel_seconds())
        self._kernel_percent: float | None = None

    def _kernel_seconds(self) -> float | None:
        """CPU seconds used so far by this process and its descendants (DataLoader workers, a torchrun and its
        workers): what the rest of the busy share is not. Each live one's own time, plus what the ones it waited for
        left in its children's counters (Linux; 0 elsewhere), so a worker that ends stays counted."""
        try:
            procs = [self._process, *self._process.children(recursive=True)]
        except self._psutil.Error:
            return None
        total = 0.0
        for proc in procs:
            try:
                t = proc.cpu_times()
            except self._psutil.Error:  # a child that just exited
                continue
            total += t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
        return total

    def _kernel(self, cpu_count: float) -> float | None:
        """This process's (and its children's) share of the CPUs since the previous sample, 0-100."""
        now, used = time.monotonic(), self._kernel_seconds()
        then, used_then = self._kernel_times
        if used is not None and used_then is not None and now - then >= 0.1:
            self._kernel_percent = min(100.0, max(0.0, (used - used_then) / (now - then) / cpu_count * 100))
            self._kernel_times = (now, used)
        elif used_then is None:
            self._kernel_times = (now, used)
        return self._kernel_percent

    def _cpu(self) -> tuple[float | None, float, bool]:
        quota = self._cgroup.cpu_quota()
        if quota is not None and quota < len(self._cpus):
            now, used = time.monotonic(), self._cgroup.cpu_usage_seconds()
            then, used_then = self._last
            if used is not None and used_then is not None and now - then >= 0.1:
                self._last_percent = min(100.0, max(0.0, (used - used_then) / (now - then) / quota * 100))
                self._last = (now, used)
            elif used_then is None:
                self._last = (now, used)
            return self._last_percent, quota, True
        now = time.monotonic()
        if now - self._cpu_asked >= 0.1:  # over a shorter span the reading is mostly noise (or 0.0)
            times = self._psutil.cpu_times(percpu=True)
            per_cpu = [_busy_percent(a, b) for a, b in zip(self._cpu_times, times)]
            self._cpu_times, self._cpu_asked = times, now
            mine = [per_cpu[i] for i in self._cpus if i < len(per_cpu)] or per_cpu
            self._last_percent = sum(mine) / len(mine) if mine else None
        return self._last_percent, float(len(self._cpus)), False

    def sample(self):

        cpu_percent, cpu_count, cpu_limited = self._cpu()
        vm = self._psutil.virtual_memory()
        ram_total, ram_used, ram_limited = vm.total, vm.total - vm.available, False
        limit = self._cgroup.memory_limit()
        if limit is not None and limit < vm.total:
            used = self._cgroup.memory_used()
            ram_total, ram_limited = limit, True
            ram_used = used if used is not None else ram_used
        try:
            rss = self._process.memory_info().rss
        except self._psutil.Error:
            rss = None
        kernel = self._kernel(cpu_count)
        if kernel is not None and cpu_percent is not None:
            kernel = min(kernel, cpu_percent)  # two readings a moment apart: never more than the whole
        return HostStats(cpu_percent=cpu_percent, cpu_count=cpu_count, cpu_limited=cpu_limited,
                         ram_used=int(ram_used), ram_total=int(ram_total), ram_limited=ram_limited,
                         process_rss=rss, kernel_cpu_percent=kernel)
