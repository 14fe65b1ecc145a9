"""Tests for course_utils.monitor: sources, lifecycle, widget message budget, TrainingProgress.

What this machine cannot show (an NVIDIA driver, unsupported NVML fields, MIG) is answered by a fake
NVML module that raises pynvml's real exception classes. Cgroup limits are staged as real files in a
temporary directory. Everything else (psutil, widgets, threads, the Trainer) is the real thing.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import comm
import pynvml
import pytest
import torch
from comm.base_comm import BaseComm
from torch import nn

from course_utils.monitor import (DeviceMonitor, HostSource, NvmlSource, Sampler, TorchSource,
                                  TrainingProgress, read_cgroup_limits)
from course_utils.monitor import loop as monitor_loop
from course_utils.monitor._widgets import fmt_bytes
from course_utils.monitor.chart import LineChart
from course_utils.monitor.host import CgroupLimits
from course_utils.monitor.nvml_source import normalize_uuid
from course_utils.monitor.stats import HostStats
from course_utils.monitor.torch_source import cuda_index
from course_utils.trainer import Callback, Trainer

GiB = 1024 ** 3


# --- a fake NVML for what this machine cannot show ---------------------------------------------

class FakeGpu:
    def __init__(self, uuid, name="Fake GPU", util=40, used=2 * GiB, total=16 * GiB, temp=55, power_mw=120_000,
                 limit_mw=300_000, unsupported=(), slices=(), mig_capable=False):
        self.uuid, self.name, self.util, self.used, self.total = uuid, name, util, used, total
        self.temp, self.power_mw, self.limit_mw = temp, power_mw, limit_mw
        self.unsupported = set(unsupported)
        self.slices = list(slices)
        self.mig_capable = mig_capable or bool(slices)
        self.fail_next: set[str] = set()  # fields that fail once with a transient error


class FakeNvml:
    """The subset of pynvml the monitor uses, answering from FakeGpu objects."""
    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE

    def __init__(self, gpus, init_error=None):
        self.gpus = gpus
        self.init_error = init_error
        self.calls = Counter()

    def nvmlInit(self):
        self.calls["init"] += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h):
        return h.uuid

    def nvmlDeviceGetName(self, h):
        return h.name

    def nvmlDeviceGetMigMode(self, h):
        if not h.mig_capable:
            raise pynvml.NVMLError_NotSupported()
        return (1 if h.slices else 0), 0

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, j):
        if j < len(h.slices):
            return h.slices[j]
        raise pynvml.NVMLError_NotFound()

    def _field(self, h, name, value):
        self.calls[name] += 1
        if name in h.unsupported:
            raise pynvml.NVMLError_NotSupported()
        if name in h.fail_next:
            h.fail_next.discard(name)
            raise pynvml.NVMLError_Unknown()
        return value

    def nvmlDeviceGetUtilizationRates(self, h):
        return self._field(h, "utilization", SimpleNamespace(gpu=h.util, memory=10))

    def nvmlDeviceGetMemoryInfo(self, h):
        return self._field(h, "memory", SimpleNamespace(used=h.used, total=h.total, free=h.total - h.used))

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._field(h, "temperature", h.temp)

    def nvmlDeviceGetPowerUsage(self, h):
        return self._field(h, "power", h.power_mw)

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._field(h, "power_limit", h.limit_mw)


UUID_A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
UUID_B = "GPU-bbbbbbbb-5555-6666-7777-888888888888"


def nvml_source(gpus, torch_uuid=None, environ=None, **kw):
    fake = FakeNvml(gpus, **kw)
    return NvmlSource(nvml=fake, torch_uuid=lambda: torch_uuid, environ=environ or {}), fake


# --- NVML -----------------------------------------------------------------------------------------

def test_nvml_missing_library_on_this_machine_gives_none_and_a_reason():
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    except pynvml.NVMLError:
        pass
    source = NvmlSource()
    assert source.sample() is None
    assert "NVML is not available" in source.reason


def test_nvml_init_failure_is_cached_not_retried_every_second():
    source, fake = nvml_source([FakeGpu(UUID_A)], init_error=pynvml.NVMLError_DriverNotLoaded())
    for _ in range(3):
        assert source.sample() is None
    assert fake.calls["init"] == 1
    assert "Driver Not Loaded" in source.reason


def test_nvml_reads_every_field_and_converts_units():
    gpu = FakeGpu(UUID_A, name="Fake H100", util=73, used=5 * GiB, total=80 * GiB, temp=61, power_mw=250_500,
                  limit_mw=700_000)
    source, fake = nvml_source([gpu])
    stats = source.sample()
    assert (stats.name, stats.utilization, stats.memory_used, stats.memory_total) == ("Fake H100", 73.0, 5 * GiB, 80 * GiB)
    assert (stats.temperature, stats.power, stats.power_limit) == (61.0, 250.5, 700.0)
    assert stats.match == "only-gpu" and not stats.mig
    source.sample()
    assert fake.calls["init"] == 1  # initialised once


def test_unsupported_fields_are_tolerated_one_by_one_and_not_asked_again():
    gpu = FakeGpu(UUID_A, unsupported={"power", "power_limit"})
    source, fake = nvml_source([gpu])
    for _ in range(3):
        stats = source.sample()
    assert stats.power is None and stats.power_limit is None
    assert stats.utilization == 40.0 and stats.memory_used == 2 * GiB and stats.temperature == 55.0
    assert fake.calls["power"] == 1 and fake.calls["utilization"] == 3


def test_transient_nvml_error_gives_none_once_then_recovers():
    gpu = FakeGpu(UUID_A)
    gpu.fail_next = {"memory"}
    source, _ = nvml_source([gpu])
    first, second = source.sample(), source.sample()
    assert first.memory_used is None and first.utilization == 40.0
    assert second.memory_used == 2 * GiB


def test_gpu_is_matched_to_torch_by_uuid_not_by_nvml_index():
    a, b = FakeGpu(UUID_A, name="first"), FakeGpu(UUID_B, name="second")
    # PyTorch prints UUIDs without the "GPU-" prefix; CUDA_VISIBLE_DEVICES=1 made NVML's device 1 torch's cuda:0
    source, _ = nvml_source([a, b], torch_uuid=UUID_B[4:].upper(), environ={"CUDA_VISIBLE_DEVICES": "1"})
    stats = source.sample()
    assert stats.name == "second" and stats.match == "uuid" and stats.uuid == UUID_B


def test_torch_uuid_unknown_to_nvml_is_reported():
    source, _ = nvml_source([FakeGpu(UUID_A)], torch_uuid="cccccccc-0000-0000-0000-000000000000")
    assert source.sample() is None
    assert "not among the GPUs NVML lists" in source.reason


def test_before_cuda_init_several_gpus_are_not_guessed():
    source, _ = nvml_source([FakeGpu(UUID_A), FakeGpu(UUID_B)])
    assert source.sample() is None
    assert "once PyTorch has initialised CUDA" in source.reason


@pytest.mark.parametrize("environ, expected", [
    ({"CUDA_VISIBLE_DEVICES": "GPU-bbbb"}, "second"),                                  # a UUID prefix
    ({"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, "second"),      # index in PCI order
    ({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, "first"),
])
def test_before_cuda_init_an_unambiguous_environment_picks_the_gpu(environ, expected):
    source, _ = nvml_source([FakeGpu(UUID_A, name="first"), FakeGpu(UUID_B, name="second")], environ=environ)
    assert source.sample().name == expected


def test_cuda_visible_devices_hiding_the_device_is_explained():
    source, _ = nvml_source([FakeGpu(UUID_A)], environ={"CUDA_VISIBLE_DEVICES": ""})
    assert source.sample() is None and "makes no cuda:0 visible" in source.reason


def test_mig_slice_memory_is_the_slices_and_chip_readings_come_from_the_parent():
    slice_uuid = "MIG-dddddddd-1111-2222-3333-444444444444"
    mig = FakeGpu(slice_uuid, name="slice", used=1 * GiB, total=10 * GiB,
                  unsupported={"utilization", "temperature", "power", "power_limit"})
    other = FakeGpu("MIG-eeeeeeee-1111-2222-3333-444444444444", used=7 * GiB, total=10 * GiB)
    parent = FakeGpu(UUID_A, name="A100", used=30 * GiB, total=80 * GiB, temp=48, power_mw=90_000,
                     unsupported={"utilization"}, slices=[other, mig])
    source, fake = nvml_source([parent], torch_uuid=slice_uuid[4:])
    for _ in range(2):
        stats = source.sample()
    assert stats.mig and stats.uuid == slice_uuid and stats.name == "slice"
    assert (stats.memory_used, stats.memory_total) == (1 * GiB, 10 * GiB)  # the slice, not the whole A100
    assert stats.utilization is None                                       # NVML has none for a MIG slice
    assert (stats.temperature, stats.power) == (48.0, 90.0)                  # the physical chip's


def test_normalize_uuid_makes_nvml_and_torch_forms_equal():
    assert normalize_uuid(b"GPU-ABCD-12") == normalize_uuid("abcd-12") == normalize_uuid("MIG-abcd-12")


# --- PyTorch allocator ----------------------------------------------------------------------------

def test_torch_source_never_initialises_cuda():
    source = TorchSource()
    assert source.sample() is None
    Sampler(nvml=False, host=False).sample()
    assert not torch.cuda.is_initialized()


@pytest.mark.parametrize("arg, index", [(None, None), (1, 1), ("cuda", None), ("cuda:2", 2),
                                        (torch.device("cuda", 3), 3)])
def test_cuda_index_accepts_cuda_devices(arg, index):
    assert cuda_index(arg) == index


@pytest.mark.parametrize("arg, message", [("cpu", "watches a CUDA device"), (-1, ">= 0"), (True, "device must be"),
                                          ("gpu:0", "device must be")])
def test_cuda_index_rejects_other_devices_with_a_clear_message(arg, message):
    with pytest.raises(ValueError, match=message):
        cuda_index(arg)


# --- host and cgroups -----------------------------------------------------------------------------

def stage_cgroups(tmp_path: Path, version: int, own: str = "/kubepods/pod1/ctr", files=None, parent_files=None):
    """A /proc/self and a cgroup mount, as real files, for read_cgroup_limits(proc=...)."""
    mount = tmp_path / "cgroup"
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    own_dir = mount / own.lstrip("/")
    own_dir.mkdir(parents=True)
    if version == 2:
        (proc / "cgroup").write_text(f"0::{own}\n")
        (proc / "mountinfo").write_text(
            f"30 23 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    else:
        (proc / "cgroup").write_text(f"4:memory:{own}\n3:cpu,cpuacct:{own}\n0::/\n")
        (proc / "mountinfo").write_text(
            f"35 31 0:32 / {mount} rw,relatime - cgroup cgroup rw,memory,cpu,cpuacct\n")
    for name, text in (files or {}).items():
        (own_dir / name).write_text(text)
    for name, text in (parent_files or {}).items():
        (own_dir.parent / name).write_text(text)
    return tmp_path / "proc", own_dir


def test_cgroup_v2_limits_take_the_smallest_along_the_ancestors(tmp_path):
    proc, own = stage_cgroups(tmp_path, 2, files={
        "memory.max": str(4 * GiB), "memory.current": str(3 * GiB), "memory.stat": f"anon 1\ninactive_file {GiB}\n",
        "cpu.max": "150000 100000", "cpu.stat": "usage_usec 2500000\nuser_usec 1\n"},
        parent_files={"memory.max": str(2 * GiB), "cpu.max": "max 100000"})
    limits = read_cgroup_limits(proc)
    assert limits.memory_version == 2 and limits.memory_dirs[0] == own
    assert limits.memory_limit() == 2 * GiB            # the pod's limit is the smaller one
    assert limits.memory_used() == 2 * GiB             # 3 GiB charged minus 1 GiB reclaimable cache
    assert limits.cpu_quota() == pytest.approx(1.5)
    assert limits.cpu_usage_seconds() == pytest.approx(2.5)


def test_cgroup_v2_without_limits(tmp_path):
    proc, _ = stage_cgroups(tmp_path, 2, files={"memory.max": "max", "memory.current": "100", "cpu.max": "max 100000",
                                                "cpu.stat": "usage_usec 1\n"})
    limits = read_cgroup_limits(proc)
    assert limits.memory_limit() is None and limits.cpu_quota() is None


def test_cgroup_v1_limits_and_the_unlimited_sentinel(tmp_path):
    proc, _ = stage_cgroups(tmp_path, 1, files={
        "memory.limit_in_bytes": str(3 * GiB), "memory.usage_in_bytes": str(2 * GiB),
        "memory.stat": f"cache 5\ntotal_inactive_file {GiB // 2}\n",
        "cpu.cfs_quota_us": "50000", "cpu.cfs_period_us": "100000", "cpuacct.usage": "4000000000"},
        parent_files={"memory.limit_in_bytes": "9223372036854771712", "cpu.cfs_quota_us": "-1",
                      "cpu.cfs_period_us": "100000"})
    limits = read_cgroup_limits(proc)
    assert limits.memory_version == 1 and limits.cpu_version == 1
    assert limits.memory_limit() == 3 * GiB and limits.memory_used() == 2 * GiB - GiB // 2
    assert limits.cpu_quota() == pytest.approx(0.5) and limits.cpu_usage_seconds() == pytest.approx(4.0)


def test_cgroup_namespace_root_is_the_mount_point(tmp_path):
    proc, _ = stage_cgroups(tmp_path, 2, own="/")
    (tmp_path / "cgroup" / "memory.max").write_text(str(GiB))
    (tmp_path / "cgroup" / "memory.current").write_text("1")
    assert read_cgroup_limits(proc).memory_limit() == GiB


def test_no_cgroups_gives_empty_limits(tmp_path):
    limits = read_cgroup_limits(tmp_path)  # no self/cgroup here, as on macOS
    assert limits == CgroupLimits() and limits.memory_limit() is None and limits.cpu_usage_seconds() is None


def test_host_source_reports_against_container_limits(tmp_path):
    import psutil

    proc, own = stage_cgroups(tmp_path, 2, files={
        "memory.max": str(GiB), "memory.current": str(GiB // 2), "memory.stat": "inactive_file 0\n",
        "cpu.max": "50000 100000", "cpu.stat": "usage_usec 0\n"})
    source = HostSource(proc=proc)
    time.sleep(0.3)
    (own / "cpu.stat").write_text("usage_usec 75000\n")  # 0.075 s of CPU in >= 0.3 s, against half a CPU
    stats = source.sample()
    assert stats.ram_limited and stats.ram_total == GiB and stats.ram_used == GiB // 2
    assert stats.cpu_limited and stats.cpu_count == 0.5
    assert 10 < stats.cpu_percent <= 50.0  # 50 % if exactly 0.3 s passed, less if the machine was slow
    assert stats.ram_total < psutil.virtual_memory().total


def test_host_source_without_limits_measures_the_machine(tmp_path):
    import psutil

    source = HostSource(proc=tmp_path)
    end = time.monotonic() + 0.4
    while time.monotonic() < end:  # keep one CPU busy so the reading cannot be the unprimed 0.0
        pass
    stats = source.sample()
    assert not stats.ram_limited and stats.ram_total == psutil.virtual_memory().total
    assert stats.cpu_count == len(os.sched_getaffinity(0))
    assert 100.0 / stats.cpu_count * 0.5 <= stats.cpu_percent <= 100.0
    assert stats.process_rss == pytest.approx(psutil.Process().memory_info().rss, rel=0.2)


def test_host_source_made_in_one_thread_reads_correctly_in_another(tmp_path):
    # the monitor makes its source in the notebook's thread and samples in its own; psutil.cpu_percent
    # keeps its baseline per thread and would answer 0.0 here
    source = HostSource(proc=tmp_path)
    end = time.monotonic() + 0.4
    while time.monotonic() < end:
        pass
    result = []
    worker = threading.Thread(target=lambda: result.append(source.sample()))
    worker.start()
    worker.join()
    assert result[0].cpu_percent >= 100.0 / result[0].cpu_count * 0.5, result[0]


def test_busy_percent_matches_psutil():
    import psutil

    from course_utils.monitor.host import _busy_percent
    before = psutil.cpu_times(percpu=True)
    psutil.cpu_percent(percpu=True)
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    theirs = psutil.cpu_percent(percpu=True)
    ours = [_busy_percent(a, b) for a, b in zip(before, psutil.cpu_times(percpu=True))]
    assert ours == pytest.approx(theirs, abs=5.0)  # the same formula over (nearly) the same span


def test_sampler_sources_are_optional_and_checked():
    snap = Sampler(nvml=False, torch=False, host=False).sample()
    assert (snap.gpu, snap.torch, snap.host, snap.notes) == (None, None, None, ())
    with pytest.raises(TypeError, match="sample"):
        Sampler(nvml="yes")


def test_sampler_combines_sources_and_notes_the_missing_ones():
    source, _ = nvml_source([FakeGpu(UUID_A), FakeGpu(UUID_B)])
    snap = Sampler(nvml=source, torch=False).sample()
    assert snap.gpu is None and snap.host is not None
    assert any(n.startswith("GPU (NVML):") and "initialised CUDA" in n for n in snap.notes)


# --- widget messages ------------------------------------------------------------------------------

class CountingComm(BaseComm):
    """A comm that records what a kernel would send to the browser (comm's documented extension point)."""
    sent: list = []

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        CountingComm.sent.append((self.comm_id, msg_type, data))


@pytest.fixture
def counted(monkeypatch):
    CountingComm.sent = []
    monkeypatch.setattr(comm, "create_comm", lambda *a, **kw: CountingComm(*a, **kw))
    return CountingComm.sent


def updates(sent) -> list:
    return [(cid, data["state"]) for cid, kind, data in sent if kind == "comm_msg" and data.get("method") == "update"]


class FixedHost:
    """A host source answering with fixed numbers, for exact message counts."""
    reason = None

    def __init__(self):
        self.stats = HostStats(cpu_percent=25.0, cpu_count=2.0, cpu_limited=False, ram_used=GiB, ram_total=8 * GiB,
                               ram_limited=False, process_rss=GiB // 4)

    def sample(self):
        return self.stats


def test_panel_sends_only_changed_values_one_message_per_widget(counted):
    source, _ = nvml_source([FakeGpu(UUID_A)])
    host = FixedHost()
    monitor = DeviceMonitor(sampler=Sampler(nvml=source, torch=False, host=host), chart_interval=3600)
    monitor.refresh()
    first = updates(counted)
    assert first, "the first refresh must fill the panel"
    assert len(first) == len({cid for cid, _ in first})  # hold_sync: one message per widget
    monitor.refresh()  # the second sample draws the first chart
    assert bytes(monitor._image.value).startswith(b"\x89PNG")
    del counted[:]
    monitor.refresh()  # nothing changed but the status line
    second = updates(counted)
    assert [state for _, state in second] == [{"value": second[0][1]["value"]}]
    assert "sample" in second[0][1]["value"]
    del counted[:]
    host.stats = HostStats(cpu_percent=75.0, cpu_count=2.0, cpu_limited=False, ram_used=GiB, ram_total=8 * GiB,
                           ram_limited=False, process_rss=GiB // 4)
    monitor.refresh()  # CPU changed: its bar (value and colour together) and its text, plus the status
    assert len(updates(counted)) == 3


def test_running_panel_stays_far_below_the_iopub_rate_limit(counted):
    monitor = DeviceMonitor(interval=0.05, chart_interval=0.2)  # 20x the default rate, real sources
    monitor.start()
    time.sleep(1.0)
    monitor.stop()
    ticks = monitor._loop.ticks
    per_tick = len(updates(counted)) / ticks
    assert ticks >= 5
    # at the default interval of 1 s this is the message rate; Jupyter drops output above 1000 msg/s
    assert per_tick <= 12, per_tick


def test_training_progress_update_sends_nothing_and_keeps_tensors(counted):
    progress = TrainingProgress(total_steps=1000)
    before = len(counted)
    losses = torch.rand(1000)
    for value in losses:
        progress.update(value)
    assert len(counted) == before  # no widget traffic from the training loop
    pending = list(progress._pending)
    assert len(pending) == 1000 and all(isinstance(v, torch.Tensor) for _, v in pending)  # no per-step .item()
    progress.refresh()
    assert progress.losses == pytest.approx(losses.tolist())
    assert progress.loss_steps == list(range(1, 1001))


# --- lifecycle ------------------------------------------------------------------------------------

def threads_named(name):
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


@pytest.fixture
def no_monitors():
    yield
    for kind in (DeviceMonitor.KIND, TrainingProgress.KIND):
        running = monitor_loop.current(kind)
        if running is not None:
            running.stop()


def test_start_stop_are_idempotent_and_the_thread_ends(no_monitors):
    monitor = DeviceMonitor(interval=0.05, sampler=Sampler(nvml=False, torch=False))
    monitor.start()
    monitor.start()
    assert len(threads_named("course_utils DeviceMonitor")) == 1
    time.sleep(0.2)
    monitor.stop()
    monitor.stop()
    assert not monitor.running and threads_named("course_utils DeviceMonitor") == []
    assert monitor._loop.ticks >= 2 and monitor.latest.host is not None
    assert monitor.start() is monitor and monitor.running  # restartable
    monitor.stop()


def test_a_second_monitor_replaces_the_first(no_monitors):
    first = DeviceMonitor(interval=0.05, sampler=Sampler(nvml=False, torch=False)).start()
    second = DeviceMonitor(interval=0.05, sampler=Sampler(nvml=False, torch=False)).start()  # the cell re-run
    assert not first.running and second.running
    assert len(threads_named("course_utils DeviceMonitor")) == 1
    assert DeviceMonitor.current() is second
    assert "stopped" in first._status.value
    second.stop()
    assert DeviceMonitor.current() is None


class Exploding:
    reason = None

    def __init__(self, after):
        self.calls, self.after = 0, after

    def sample(self):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("sensor on fire")
        return None


def test_an_error_in_a_sampler_ends_the_thread_quietly_and_is_shown(no_monitors, capfd):
    source = Exploding(after=2)
    monitor = DeviceMonitor(interval=0.02, sampler=Sampler(nvml=source, torch=False, host=False)).start()
    deadline = time.monotonic() + 5
    while monitor.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not monitor.running and source.calls == 3
    assert isinstance(monitor.error, RuntimeError)
    assert "sensor on fire" in monitor._error.value and monitor._error.layout.display is None
    assert DeviceMonitor.current() is None
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # a thread that prints would write into whatever cell is running


def test_context_manager_starts_and_stops_and_prints_nothing_outside_a_kernel(no_monitors, capfd):
    with DeviceMonitor(interval=0.05, sampler=Sampler(nvml=False, torch=False)) as monitor:
        assert monitor.running
        time.sleep(0.15)
    assert not monitor.running and monitor.latest is not None
    assert capfd.readouterr() == ("", "")


@pytest.mark.parametrize("kwargs", [{"interval": 0}, {"interval": -1}, {"chart_interval": 0}, {"history": 0}])
def test_bad_intervals_are_rejected(kwargs):
    with pytest.raises(ValueError, match="positive"):
        DeviceMonitor(sampler=Sampler(nvml=False, torch=False, host=False), **kwargs)


def test_panel_without_gpu_shows_host_and_says_why(no_monitors):
    monitor = DeviceMonitor(sampler=Sampler(nvml=nvml_source([], init_error=pynvml.NVMLError_LibraryNotFound())[0],
                                            torch=False))
    time.sleep(0.15)  # a CPU reading needs a span of at least 0.1 s since the source was made
    monitor.refresh()
    assert monitor._gpu_box.layout.display == "none" and monitor._torch_box.layout.display == "none"
    assert monitor._host_box.layout.display is None
    assert "NVML is not available" in monitor._notes.value
    assert "% of" in monitor._host["cpu"].text.value


def test_panel_labels_gpu_as_whole_gpu_and_torch_as_this_kernel():
    gpu = FakeGpu(UUID_A, name="Fake L4", used=3 * GiB, total=24 * GiB)
    monitor = DeviceMonitor(sampler=Sampler(nvml=nvml_source([gpu])[0], torch=False, host=FixedHost()))
    monitor.refresh()
    assert "whole GPU (NVML)" in monitor._gpu_title.value and "Fake L4" in monitor._gpu_title.value
    assert "this kernel (PyTorch)" in monitor._torch_title.value
    assert monitor._gpu["mem"].text.value == "3.00 GiB / 24.0 GiB"
    assert monitor._gpu["mem"].bar.value == pytest.approx(12.5)


def test_history_chart_is_a_png_redrawn_at_most_every_chart_interval():
    monitor = DeviceMonitor(sampler=Sampler(nvml=False, torch=False, host=FixedHost()), chart_interval=3600)
    monitor.refresh()
    assert monitor._image.value == b""  # one sample is not a history yet
    monitor.refresh()
    png = monitor._image.value
    assert bytes(png).startswith(b"\x89PNG")
    monitor.refresh()
    assert monitor._image.value is png  # within chart_interval: not redrawn


@pytest.mark.parametrize("n, text", [(None, "n/a"), (512, "512 B"), (1000, "0.977 KiB"), (5 * 2**20, "5.00 MiB"),
                                     (int(1.02 * GiB), "1.02 GiB"), (int(23.5 * GiB), "23.5 GiB"),
                                     (200 * 2**20, "200 MiB")])
def test_byte_counts_keep_three_significant_digits(n, text):
    assert fmt_bytes(n) == text


def _pixels(png: bytes) -> bytes:
    import io

    from PIL import Image
    return Image.open(io.BytesIO(png)).convert("RGBA").tobytes()


def test_line_chart_blits_and_matches_a_full_redraw():
    series = [("a", "red"), ("b", "blue")]
    x = list(range(50))
    first = [[float(i % 7) for i in x], [None] * 50]
    second = [[float(i % 5) for i in x], [3.0] * 50]
    blitted = LineChart(series, xlim=(0, 60), ylim=(0, 10))
    blitted.render(x, first)
    png = blitted.render(x, second)  # the legend gains "b": one more full redraw
    png_again = blitted.render(x, second)
    assert blitted.full_redraws == 2
    fresh = LineChart(series, xlim=(0, 60), ylim=(0, 10))
    assert _pixels(fresh.render(x, second)) == _pixels(png) == _pixels(png_again)
    assert _pixels(fresh.render(x, first)) != _pixels(png)


def test_line_chart_axes_follow_a_falling_loss_with_few_redraws():
    chart = LineChart([("loss", "red")])
    losses = [2.5 * 0.995 ** i for i in range(1000)]
    for n in range(10, 1001, 10):
        chart.render(list(range(n)), [losses[:n]])
    assert chart.full_redraws <= 15  # 100 renders
    lo, hi = chart._ax.get_ylim()
    assert lo <= min(losses) and hi >= max(losses)


def test_line_chart_checks_its_input_and_draws_gaps():
    chart = LineChart([("a", "red"), ("b", "blue")])
    assert chart.render([0, 1, 2], [[1, None, 3], [None, None, None]]).startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="expected 2 series"):
        chart.render([0], [[1]])


# --- TrainingProgress -----------------------------------------------------------------------------

class RecordLosses(Callback):
    """The oracle: what the Trainer's losses were, read with .item() (fine in a test)."""

    def __init__(self):
        self.losses = []

    def on_batch_end(self, trainer, loss):
        self.losses.append(loss.item())


def test_training_progress_as_a_trainer_callback(no_monitors):
    torch.manual_seed(0)
    x, y = torch.randn(96, 8), torch.randint(0, 3, (96,))
    loader = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 96, 16)]
    model = nn.Linear(8, 3)
    progress, oracle = TrainingProgress(epochs=2, interval=0.02), RecordLosses()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), loader,
                      device="cpu", callbacks=[progress, oracle])
    trainer(2)
    assert not progress.running and threads_named("course_utils TrainingProgress") == []
    assert progress.steps == 12 and progress.loss_steps == list(range(1, 13))
    assert progress.losses == pytest.approx(oracle.losses)
    assert (progress._bar.value, progress._bar.max, progress._bar.bar_style) == (12, 12, "success")
    assert "12/12 steps" in progress._bar_text.value and "steps/s" in progress._bar_text.value
    assert f"loss {trainer.history[-1]:.4g}" in progress._text.value  # the epoch's mean loss from on_epoch_end
    assert bytes(progress._image.value).startswith(b"\x89PNG")
    progress.epochs = 1
    trainer(1)  # a second call continues the step count; the bar covers just that run
    assert progress.steps == 18 and progress.loss_steps[-1] == 18
    assert (progress._bar.value, progress._bar.max) == (6, 6)


def test_training_progress_standalone_reports_rate_and_time_left(no_monitors):
    with TrainingProgress(total_steps=100, interval=0.05) as progress:
        for _ in range(40):
            progress.update(torch.tensor(1.0))
            time.sleep(0.005)
        progress.refresh()
        text = progress._bar_text.value
    assert "40/100 steps" in text and "left" in text and "? steps/s" not in text
    assert progress._bar.value == 40 and progress._bar.bar_style == ""  # stopped short of the total


def test_smoothed_loss_is_unbiased_and_survives_nan():
    progress = TrainingProgress(smoothing=0.1)
    for v in [2.0] * 10 + [float("nan")] + [2.0] * 5:
        progress.update(v)
    progress.refresh()
    assert progress.smoothed == pytest.approx([2.0] * 16)  # no ramp up from zero, NaN not averaged in
    assert progress.losses[10] != progress.losses[10]


def test_loss_history_is_bounded():
    progress = TrainingProgress()
    values = torch.arange(5000, dtype=torch.float32)
    for v in values:
        progress.update(v)
    progress.refresh()
    assert len(progress.losses) <= 4000
    assert sum(progress.losses) / len(progress.losses) == pytest.approx(values.mean().item(), rel=1e-3)


def test_losses_waiting_without_a_running_thread_are_bounded():
    from course_utils.monitor.progress import _MAX_PENDING

    progress = TrainingProgress()
    loss = torch.zeros(())
    for _ in range(_MAX_PENDING + 10):
        progress.update(loss)
    assert len(progress._pending) == _MAX_PENDING and progress.steps == _MAX_PENDING + 10
    assert progress._pending[0][0] == 11  # the oldest were dropped


def test_update_validates_and_detaches():
    progress = TrainingProgress()
    with pytest.raises(ValueError, match="single number"):
        progress.update(torch.ones(3))
    with pytest.raises(TypeError, match="tensor, a number or None"):
        progress.update("0.5")
    w = torch.ones((), requires_grad=True)
    progress.update(w * 2)
    assert not progress._pending[-1][1].requires_grad  # the autograd graph is not kept alive


@pytest.mark.parametrize("kwargs", [{"total_steps": -1}, {"epochs": 1.5}, {"smoothing": 0}, {"chart_interval": 0},
                                    {"interval": 0}])
def test_training_progress_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        TrainingProgress(**kwargs)


def test_training_progress_replaces_a_running_one(no_monitors):
    first = TrainingProgress(interval=0.05).start()
    second = TrainingProgress(interval=0.05).start()
    assert not first.running and second.running
    assert len(threads_named("course_utils TrainingProgress")) == 1
    second.stop()


# --- importing has no side effects ----------------------------------------------------------------

def test_import_starts_nothing_and_initialises_nothing():
    code = textwrap.dedent("""
        import sys, threading
        import course_utils.monitor
        import torch
        assert threading.active_count() == 1, threading.enumerate()
        assert not torch.cuda.is_initialized()
        for mod in ("ipywidgets", "matplotlib", "psutil"):  # (torch itself imports pynvml)
            assert mod not in sys.modules, mod
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""


# --- on a machine with an NVIDIA GPU (skipped here) -----------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_real_gpu_torch_and_nvml_describe_the_same_device():
    # in a subprocess, so this test process never initialises CUDA
    code = textwrap.dedent("""
        import torch
        from course_utils.monitor import DeviceMonitor, Sampler
        sampler = Sampler(host=False)
        before = sampler.sample()
        assert before.torch is None and not torch.cuda.is_initialized(), before  # sampling did not init CUDA
        x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        snap = sampler.sample()
        t, g = snap.torch, snap.gpu
        assert t.allocated >= x.numel() and t.reserved >= t.allocated and t.peak >= t.allocated, t
        assert g is not None and g.match == "uuid", snap
        assert g.memory_used >= t.reserved, (g, t)  # NVML counts the whole GPU, this kernel included
        assert abs(g.memory_total - torch.cuda.get_device_properties(0).total_memory) <= 0.05 * g.memory_total
        assert g.utilization is None or 0 <= g.utilization <= 100
        monitor = DeviceMonitor()
        monitor.refresh()
        assert monitor._gpu_box.layout.display is None and monitor._torch_box.layout.display is None
        print("ok", g.name, g.match, t.device)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok")


def test_panel_shows_this_kernels_cpu_beside_other_processes(counted):
    host = FixedHost()
    host.stats = HostStats(cpu_percent=80.0, cpu_count=2.0, cpu_limited=False, ram_used=GiB, ram_total=8 * GiB,
                           ram_limited=False, process_rss=GiB // 4, kernel_cpu_percent=30.0)
    monitor = DeviceMonitor(sampler=Sampler(nvml=False, torch=False, host=host), chart_interval=3600)
    monitor.refresh()
    texts = [state.get("value", "") for _, state in updates(counted) if isinstance(state.get("value"), str)]
    assert any("80.0 % of 2 CPUs (this kernel 30 %, other processes 50 %)" in t for t in texts), texts


def test_host_source_counts_this_process_and_not_a_busy_neighbour():
    from course_utils.monitor import HostSource
    from course_utils.threads import BusyCores

    source = HostSource()
    with BusyCores(1):
        time.sleep(0.6)
        sample = source.sample()
    busy_cpus = sample.cpu_percent / 100 * sample.cpu_count
    mine_cpus = sample.kernel_cpu_percent / 100 * sample.cpu_count
    assert busy_cpus >= 0.6 and mine_cpus < 0.3, sample  # a whole core busy, and it is someone else's
