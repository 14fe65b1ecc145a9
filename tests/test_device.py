"""Device choice and the environment diagnosis. The diagnosis branches are fed faked NVML/torch answers:
a missing driver, a CPU-only build, an old driver or a hidden GPU cannot be staged on this machine."""
import pytest
import torch

from course_utils import describe_environment, get_device
from course_utils.device import NvmlInfo, TorchInfo, diagnose, query_nvml, query_torch


def torch_info(cuda_build="12.4", available=False, hip=None):
    return TorchInfo(version="2.6.0", cuda_build=cuda_build, hip_build=hip, cuda_available=available,
                     device_count=1 if available else 0, mps_available=False)


GOOD_DRIVER = NvmlInfo(True, driver_version="550.54", cuda_driver_version=(12, 4), gpus=["NVIDIA GeForce RTX 3060"])


def test_get_device_defaults_to_the_best_available():
    expected = "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    assert get_device().type == expected


def test_env_var_and_explicit_preference_override(monkeypatch):
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    assert get_device() == torch.device("cpu")
    monkeypatch.setenv("COURSE_DEVICE", "meta")
    assert get_device() == torch.device("meta")
    assert get_device("cpu") == torch.device("cpu")  # explicit beats the variable


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_asking_for_missing_cuda_says_what_to_do():
    with pytest.raises(ValueError, match="describe_environment"):
        get_device("cuda")


def test_no_driver_is_reported_first():
    steps = diagnose(torch_info(), NvmlInfo(False, error="NVML Shared Library Not Found"), env={})
    assert not steps[0].ok and "NVML Shared Library Not Found" in steps[0].finding
    assert len(steps) == 2  # nothing more can be learnt without a driver


def test_cpu_only_build_with_a_gpu_present_is_the_diagnosis():
    steps = diagnose(torch_info(cuda_build=None), GOOD_DRIVER, env={})
    assert steps[0].ok
    assert not steps[-1].ok and "CPU-only build" in steps[-1].finding
    assert "README" in steps[-1].finding


def test_driver_too_old_for_the_build():
    old = NvmlInfo(True, driver_version="470.1", cuda_driver_version=(11, 4), gpus=["Tesla T4"])
    steps = diagnose(torch_info(cuda_build="12.4"), old, env={})
    assert not steps[-1].ok
    assert "11.4" in steps[-1].finding and "12.4" in steps[-1].finding


@pytest.mark.parametrize("value", ["", "-1"])
def test_gpu_hidden_by_cuda_visible_devices(value):
    steps = diagnose(torch_info(), GOOD_DRIVER, env={"CUDA_VISIBLE_DEVICES": value})
    assert not steps[-1].ok and "CUDA_VISIBLE_DEVICES" in steps[-1].finding and repr(value) in steps[-1].finding


def test_everything_looks_right_but_cuda_failed_to_start():
    t = torch_info()
    t.cuda_error = "CUDA unknown error"
    steps = diagnose(t, GOOD_DRIVER, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert [s.ok for s in steps[:-1]] == [True] * (len(steps) - 1)
    assert "CUDA unknown error" in steps[-1].finding


def test_report_for_a_faked_gpu_less_machine_lists_the_diagnosis():
    report = str(describe_environment(torch_info(cuda_build=None), GOOD_DRIVER, env={}))
    assert "CPU-only build" in report and "Diagnosis for this machine" in report
    assert "driver: 550.54" in report


def test_real_report_on_this_machine_is_consistent():
    t, n = query_torch(), query_nvml()
    report = describe_environment()
    text = str(report)
    assert torch.__version__ in text
    assert ("CPU-only" in text) == (torch.version.cuda is None and not getattr(torch.version, "hip", None))
    if not t.cuda_available and not t.mps_available:
        assert report.steps and "Diagnosis for this machine" in text
    assert report.device == get_device()
    assert n.available or n.error


class FakeDriver:
    """The part of pynvml that query_nvml reads, as an older binding answers it (bytes)."""

    def __init__(self, names=(b"NVIDIA A100-SXM4-40GB", b"NVIDIA A100-SXM4-40GB"), init_error=None):
        self.names, self.init_error, self.calls = list(names), init_error, []

    def nvmlInit(self):
        self.calls.append("init")
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlSystemGetDriverVersion(self):
        return b"550.54.14"

    def nvmlSystemGetCudaDriverVersion(self):
        return 12040

    def nvmlDeviceGetCount(self):
        return len(self.names)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h:08d}-0000-0000-0000-000000000000".encode()

    def nvmlDeviceGetName(self, h):
        return self.names[h]


def test_query_nvml_reads_the_driver_through_one_init_shutdown_pair():
    fake = FakeDriver()
    info = query_nvml(fake)
    assert info == NvmlInfo(True, driver_version="550.54.14", cuda_driver_version=(12, 4),
                            gpus=["NVIDIA A100-SXM4-40GB"] * 2)
    assert fake.calls == ["init", "shutdown"]
    import pynvml

    failed = FakeDriver(init_error=pynvml.NVMLError_DriverNotLoaded())
    info = query_nvml(failed)
    assert not info.available and "Driver Not Loaded" in info.error and failed.calls == ["init"]


def test_device_choice_and_diagnosis_do_not_import_the_monitor():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, course_utils.device, course_utils.environment, course_utils.nvml; "
            "assert not [m for m in sys.modules if m.startswith('course_utils.monitor')]; "
            "from course_utils.device import describe_environment, diagnose, query_nvml; "
            "from course_utils.environment import describe_environment as d; assert d is describe_environment")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
