"""Device choice and the environment diagnosis. The diagnosis branches are fed faked NVML/torch answers:
a missing driver, a CPU-only build, an old driver or a hidden GPU cannot be staged on this machine."""
import itertools

import pytest
import torch

from course_utils import describe_environment, get_device
from course_utils.environment import NvmlInfo, TorchInfo, count_visible, diagnose, query_nvml, query_torch
from course_utils.nvml import visible_devices


def torch_info(cuda_build="12.4", available=False, hip=None):
    return TorchInfo(version="2.6.0", cuda_build=cuda_build, hip_build=hip, cuda_available=available,
                     device_count=1 if available else 0, mps_available=False)


GOOD_DRIVER = NvmlInfo(True, driver_version="550.54", cuda_driver_version=(12, 4), gpus=["NVIDIA GeForce RTX 3060"])
UUID_DRIVER = NvmlInfo(True, driver_version="550.54", cuda_driver_version=(12, 4), gpus=["NVIDIA GeForce RTX 3060"] * 2,
                       uuids=["GPU-00000000-1111", "GPU-00000001-2222"])


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
    checklist = diagnose(torch_info(), NvmlInfo(False, error="NVML Shared Library Not Found"), env={})
    assert not checklist[0].ok and "NVML Shared Library Not Found" in checklist[0].finding
    assert len(checklist) == 2  # nothing more can be learnt without a driver


def test_cpu_only_build_with_a_gpu_present_is_the_diagnosis():
    checklist = diagnose(torch_info(cuda_build=None), GOOD_DRIVER, env={})
    assert checklist[0].ok
    assert not checklist[-1].ok and "CPU-only build" in checklist[-1].finding
    assert "README" in checklist[-1].finding


def test_driver_too_old_for_the_build():
    old = NvmlInfo(True, driver_version="470.1", cuda_driver_version=(11, 4), gpus=["Tesla T4"])
    checklist = diagnose(torch_info(cuda_build="12.4"), old, env={})
    assert not checklist[-1].ok
    assert "11.4" in checklist[-1].finding and "12.4" in checklist[-1].finding


@pytest.mark.parametrize("value, why", [("", "empty"), ("-1", "'-1', is not a GPU index"),
                                        ("none", "'none', is not a GPU index"), ("-1,0", "'-1', is not a GPU index"),
                                        ("5", "GPU 5 does not exist"), ("5,0", "GPU 5 does not exist"),
                                        ("0,0", "named twice"), ("0,1,00", "named twice"),
                                        ("GPU-ffff", "'GPU-ffff' matches no GPU"), ("GPU-", "more than one"),
                                        ("GPU-00000000,GPU-00000000", "named twice")])
def test_gpu_hidden_by_cuda_visible_devices(value, why):
    """Every way a value shows none of the machine's GPUs, as PyTorch reads it, is found, with its cause."""
    checklist = diagnose(torch_info(), UUID_DRIVER, env={"CUDA_VISIBLE_DEVICES": value})
    assert not checklist[-1].ok and "CUDA_VISIBLE_DEVICES" in checklist[-1].finding and repr(value) in checklist[-1].finding
    assert why in checklist[-1].finding and "2 GPU(s)" in checklist[-1].finding


@pytest.mark.parametrize("value, shown", [("0", 1), ("1,0", 2), ("0,5,1", 1), ("1,-1,0", 1), ("1gpu", 1),
                                          ("GPU-00000001", 1), ("GPU-00000001,GPU-0000000", 1)])
def test_gpus_shown_by_cuda_visible_devices_are_counted(value, shown):
    checklist = diagnose(torch_info(), UUID_DRIVER, env={"CUDA_VISIBLE_DEVICES": value})
    step = next(s for s in checklist if "CUDA_VISIBLE_DEVICES" in s.question)
    assert step.ok and f"shows {shown} of the 2 GPU(s)" in step.finding


@pytest.mark.parametrize("value, why", [("GPU-00000000,GPU-00000000-1", "named twice"),
                                        ("GPU-00000001-2222,GPU-0000000", "'GPU-0000000' matches more than one")])
def test_two_prefixes_of_one_gpu_and_an_ambiguous_prefix_get_their_own_cause(value, why):
    checklist = diagnose(torch_info(), UUID_DRIVER, env={"CUDA_VISIBLE_DEVICES": value})
    if "named twice" in why:
        assert not checklist[-1].ok and why in checklist[-1].finding
    else:  # the first prefix names a GPU: one is shown
        item = next(s for s in checklist if "CUDA_VISIBLE_DEVICES" in s.question)
        assert item.ok and "shows 1 of the 2" in item.finding


def test_cuda_visible_devices_is_not_judged_when_nvml_lists_no_gpus():
    """NVML answered but listed no GPUs (a device query failed): nothing says which GPUs exist, so the value is not
    blamed, except one that hides everything whatever the GPUs."""
    no_list = NvmlInfo(True, driver_version="550.54", cuda_driver_version=(12, 4), gpus=[])
    for value in ("0", "GPU-aa", "3,1"):
        item = next(s for s in diagnose(torch_info(), no_list, env={"CUDA_VISIBLE_DEVICES": value})
                    if "CUDA_VISIBLE_DEVICES" in s.question)
        assert item.ok and "not checked here" in item.finding, (value, item)
    assert count_visible("", no_list) == 0 and count_visible("-1", no_list) == 0


def test_mig_devices_in_cuda_visible_devices_are_not_guessed():
    checklist = diagnose(torch_info(), UUID_DRIVER, env={"CUDA_VISIBLE_DEVICES": "MIG-1234"})
    step = next(s for s in checklist if "CUDA_VISIBLE_DEVICES" in s.question)
    assert step.ok and "not checked here" in step.finding


def _every_value():
    """CUDA_VISIBLE_DEVICES values of one to three entries, from entries that probe every rule of the parse."""
    entries = ["0", "1", "3", "4", "7", "-1", "", "+1", "01", " 1", "1 ", "1gpu", "gpu", "none", "NoDevFiles",
               "GPU-aa", "GPU-a", "GPU-b333", "GPU-zz", "MIG-x", "gpu-aa"]
    for n in (1, 2, 3):
        yield from (",".join(p) for p in itertools.product(entries, repeat=n))


def test_cuda_visible_devices_is_read_as_pytorch_reads_it(monkeypatch):
    """PyTorch itself is the oracle: for every value, the same GPUs named and the same count on a 4-GPU machine
    (torch.cuda's parse and count, with NVML's answers stood in)."""
    uuids = ["GPU-aa11", "GPU-ab22", "GPU-b333", "GPU-c444"]
    machine = NvmlInfo(True, gpus=["GPU"] * 4, uuids=uuids)
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: 4)
    monkeypatch.setattr(torch.cuda, "_raw_device_uuid_nvml", lambda: uuids)
    checked = 0
    for value in _every_value():
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        try:
            expected, count = torch.cuda._parse_visible_devices(), torch.cuda._device_count_nvml()
        except ValueError:  # torch's own parse fails on a lone sign ("+"): nothing to compare
            continue
        assert visible_devices(value) == expected, value
        assert count_visible(value, machine) == (None if count == -1 else count), value
        checked += 1
    assert checked > 9000


def test_everything_looks_right_but_cuda_failed_to_start():
    t = torch_info()
    t.cuda_error = "CUDA unknown error"
    checklist = diagnose(t, GOOD_DRIVER, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert [s.ok for s in checklist[:-1]] == [True] * (len(checklist) - 1)
    assert "CUDA unknown error" in checklist[-1].finding


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
        assert report.checklist and "Diagnosis for this machine" in text
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

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return (8, 0)


def test_query_nvml_reads_the_driver_through_one_init_shutdown_pair():
    fake = FakeDriver()
    info = query_nvml(fake)
    assert info == NvmlInfo(True, driver_version="550.54.14", cuda_driver_version=(12, 4),
                            gpus=["NVIDIA A100-SXM4-40GB"] * 2, capabilities=[(8, 0)] * 2,
                            uuids=[f"GPU-{i:08d}-0000-0000-0000-000000000000" for i in range(2)])
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
            "from course_utils.environment import describe_environment, diagnose, query_nvml; "
            "from course_utils.environment import describe_environment as d; assert d is describe_environment")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr


# --- compatibility rules, fed with facts recorded from real machines --------------------------------------

# torch.cuda.get_arch_list() of two real builds: torch 2.14.1+cu130 (this course's) and torch 2.5.1+cu124
ARCH_CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
ARCH_CU124 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


@pytest.mark.parametrize("build, driver_cuda, driver, ok, words", [
    ((12, 4), (12, 4), "550.54.14", True, "supports CUDA 12.4"),
    ((12, 4), (12, 2), "535.183.01", True, "minor-version compatibility"),  # older 12.x driver, newer 12.x build
    ((12, 8), (13, 0), "580.65.06", True, "supports CUDA 13.0"),             # backward compatibility
    ((13, 0), (12, 9), "575.57.08", False, "to 580 or newer"),                # a CUDA 13 build needs the 580 branch
    ((11, 8), (11, 0), "450.51.06", False, "to 450.80.02 or newer"),          # CUDA 11.0's own driver is too old
    ((11, 8), (11, 0), "450.80.02", True, "minor-version compatibility"),     # the exact minimum
    ((12, 4), (12, 0), "525.60.12", False, "to 525.60.13 or newer"),
    ((12, 1), (11, 4), "470.256.02", False, "CUDA 11.x"),
    ((10, 2), (10, 1), "418.67", False, "update the driver"),                 # before CUDA 11: no minor compatibility
])
def test_driver_against_build_uses_cuda_s_compatibility_rules(build, driver_cuda, driver, ok, words):
    from course_utils.environment import driver_runs_build

    got, why = driver_runs_build(build, driver_cuda, driver)
    assert got is ok and words in why


@pytest.mark.parametrize("capability, archs, ok, words", [
    ((8, 6), ARCH_CU130, True, "machine code"),          # RTX 3060 Laptop (the seed article's GPU)
    ((8, 9), ARCH_CU130, True, "machine code"),          # RTX 4090: sm_86 code runs on 8.9
    ((12, 1), ARCH_CU130, True, "machine code"),         # same major as sm_120
    ((7, 0), ARCH_CU130, False, "too old"),               # V100 on a CUDA 13 build
    ((6, 1), ARCH_CU130, False, "too old"),               # GTX 1080
    ((10, 0), ARCH_CU124, False, "newer than anything"),  # B200 on a CUDA 12.4 build
    ((10, 0), ARCH_CU124 + ["compute_90"], True, "PTX"),   # a build that ships PTX: JIT-compiled
    ((9, 0), ["sm_90a"], True, "machine code"),
    ((10, 0), ["sm_90a"], False, "newer"),                 # arch-specific code runs only on that GPU
    ((10, 3), ["sm_100f"], True, "machine code"),          # family code runs on the family
])
def test_build_against_gpu(capability, archs, ok, words):
    from course_utils.environment import build_supports_gpu

    got, why = build_supports_gpu(capability, archs)
    assert got is ok and words in why


def test_a_gpu_too_old_for_the_build_is_the_diagnosis():
    import dataclasses

    t = dataclasses.replace(torch_info(cuda_build="13.0"), arch_list=ARCH_CU130)
    v100 = NvmlInfo(True, driver_version="580.65.06", cuda_driver_version=(13, 0), gpus=["Tesla V100-SXM2-16GB"],
                    capabilities=[(7, 0)])
    checklist = diagnose(t, v100, env={})
    assert checklist[-1].question == "Does this PyTorch build support this GPU?" and not checklist[-1].ok
    assert "Tesla V100" in checklist[-1].finding and "too old" in checklist[-1].finding
    fine = dataclasses.replace(v100, gpus=["NVIDIA H100"], capabilities=[(9, 0)])
    assert all(s.ok for s in diagnose(t, fine, env={})[:4])


@pytest.mark.parametrize("cuda", ["13.0", "13.2"])
def test_machine_code_verdicts_are_pytorchs_own(monkeypatch, cuda):
    """PyTorch's table of which GPUs run which machine code (torch.cuda._code_compatible_with_device, Jetson
    exceptions and CUDA 13.2's change included) is the oracle: every code version it knows against every GPU."""
    from course_utils.environment import build_supports_gpu

    monkeypatch.setattr(torch.version, "cuda", cuda)
    codes = sorted(torch.cuda.DEVICE_REQUIREMENT)
    gpus = sorted({*codes, 51, 75, 89, 103, 121} | {10 * major + minor for major in range(5, 13) for minor in range(10)})
    build = tuple(int(p) for p in cuda.split("."))
    for code in codes:
        for gpu in gpus:
            expected = torch.cuda._code_compatible_with_device(gpu, code)
            got, why = build_supports_gpu(divmod(gpu, 10), [f"sm_{code}"], build)
            assert got is expected, (code, gpu, why)


@pytest.mark.parametrize("capability, archs, ok, words", [
    ((12, 0), ["compute_100f"], False, "newer"),              # family PTX serves its family only (10.0, 10.3)
    ((10, 3), ["compute_100f"], True, "PTX"),
    ((9, 0), ["compute_90a"], True, "PTX"),                   # arch-specific PTX: exactly that GPU
    ((10, 0), ["compute_90a"], False, "newer"),
    ((9, 0), ["sm_80", "sm_100", "sm_120"], False, "older and newer"),  # a gap in the list, not a too-new GPU
    ((6, 1), ["sm_50", "sm_70"], False, "older and newer"),
    ((8, 0), ["sm_90a"], False, "too old"),
    ((8, 0), ["sm_87"], False, "for Jetson GPUs"),            # a Jetson-only build on a discrete GPU
])
def test_ptx_variants_and_the_cause_of_a_missing_code(capability, archs, ok, words):
    from course_utils.environment import build_supports_gpu

    got, why = build_supports_gpu(capability, archs)
    assert got is ok and words in why, why


def test_a_jetson_is_told_to_get_a_jetson_build():
    from course_utils.environment import build_supports_gpu

    ok, why = build_supports_gpu((8, 7), ["sm_75", "sm_80", "sm_86", "sm_90"], (13, 0))
    assert not ok and "Jetson" in why and "sm_87" in why
