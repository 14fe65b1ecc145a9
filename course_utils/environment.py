"""Environment diagnosis: what this machine has, and why no GPU is usable when none is.

`describe_environment()` reports the PyTorch build, the devices, the NVIDIA driver and the CPU; when no
GPU is usable it walks the course's checklist (`diagnose`) and says what it found at each step. The
facts come from `query_torch()` (this PyTorch build and runtime) and `query_nvml()` (the driver, read
through `course_utils.nvml`); `diagnose` is a pure function of them, so every branch can be tested
with faked answers.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field

import torch

from . import nvml as nvml_reader
from .device import get_device, mps_available

__all__ = [
    "EnvironmentReport", "NvmlInfo", "Step", "TorchInfo", "describe_environment", "diagnose", "query_nvml",
    "query_torch",
]


# --- facts about the machine -------------------------------------------------------------

@dataclass
class NvmlInfo:
    """What the NVIDIA driver (through NVML) says, independently of PyTorch."""
    available: bool  # could the NVML library be loaded and initialised at all
    error: str | None = None
    driver_version: str | None = None
    cuda_driver_version: tuple[int, int] | None = None  # highest CUDA runtime the driver supports
    gpus: list[str] = field(default_factory=list)


def query_nvml(nvml=None) -> NvmlInfo:
    """Ask NVML (nvidia-ml-py) about the driver and GPUs. Never raises. `nvml`: the binding (default
    `pynvml`), or a stand-in in tests."""
    if nvml is None:
        try:
            nvml = nvml_reader.load()
        except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a dependency
            return NvmlInfo(False, error=f"nvidia-ml-py is not installed ({exc})")
    with nvml_reader.session(nvml) as error:
        if error is not None:
            return NvmlInfo(False, error=error)
        info = NvmlInfo(True, driver_version=nvml_reader.driver_version(nvml),
                        cuda_driver_version=nvml_reader.cuda_driver_version(nvml))
        try:
            info.gpus = [nvml_reader.device_name(nvml, d.handle) for d in nvml_reader.list_devices(nvml, mig=False)]
        except Exception:
            pass
        return info


@dataclass
class TorchInfo:
    """What this PyTorch build and runtime say."""
    version: str
    cuda_build: str | None  # torch.version.cuda: None on a CPU-only build
    hip_build: str | None
    cuda_available: bool
    device_count: int
    mps_available: bool
    cuda_error: str | None = None  # the warning/error torch gave when CUDA init failed


def query_torch() -> TorchInfo:
    import warnings

    err = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    for w in caught:
        err = str(w.message)
    return TorchInfo(
        version=torch.__version__,
        cuda_build=torch.version.cuda,
        hip_build=getattr(torch.version, "hip", None),
        cuda_available=available,
        device_count=torch.cuda.device_count() if available else 0,
        mps_available=mps_available(),
        cuda_error=err,
    )


@dataclass
class Step:
    question: str
    finding: str
    ok: bool


def diagnose(torch_info: TorchInfo, nvml: NvmlInfo, env: dict | None = None) -> list[Step]:
    """The course's checklist for "why is there no GPU?", answered for this machine.

    Pure function of its inputs so every branch can be unit-tested with faked answers.
    Stops adding steps after the first one that explains the problem.
    """
    env = dict(os.environ) if env is None else env
    steps: list[Step] = []

    # 1. Is a driver visible?
    if nvml.available:
        gpus = ", ".join(nvml.gpus) if nvml.gpus else "no GPUs listed"
        steps.append(Step("Is an NVIDIA driver visible?",
                          f"yes: driver {nvml.driver_version or '?'} ({gpus})", True))
    else:
        steps.append(Step("Is an NVIDIA driver visible?",
                          f"no: NVML could not be loaded ({nvml.error}). Either this machine has no NVIDIA GPU, "
                          "or its driver is not installed or not loaded. `nvidia-smi` in a terminal should list "
                          "the GPU; if it does not, install the driver first.", False))

    # 2. Is this a CPU-only build of torch?
    if torch_info.hip_build:
        steps.append(Step("Is this PyTorch build able to use a GPU?",
                          f"yes: a ROCm (HIP {torch_info.hip_build}) build", True))
    elif torch_info.cuda_build is None:
        steps.append(Step("Is this PyTorch build able to use a GPU?",
                          f"no: torch {torch_info.version} is a CPU-only build (torch.version.cuda is None). "
                          "Reinstall torch with a CUDA build (see the README) if this machine has an NVIDIA GPU.",
                          not nvml.available))
        if nvml.available:
            return steps
    else:
        steps.append(Step("Is this PyTorch build able to use a GPU?",
                          f"yes: torch {torch_info.version} was built with CUDA {torch_info.cuda_build}", True))

    if not nvml.available:
        return steps

    # 3. Is the driver new enough for the build's CUDA?
    if torch_info.cuda_build and nvml.cuda_driver_version:
        need = tuple(int(p) for p in torch_info.cuda_build.split(".")[:2])
        have = nvml.cuda_driver_version
        if have < need:
            steps.append(Step("Is the driver new enough for this build's CUDA?",
                              f"no: the driver supports CUDA up to {have[0]}.{have[1]}, but this torch needs "
                              f"CUDA {need[0]}.{need[1]}. Update the driver, or install a torch build for an "
                              "older CUDA.", False))
            return steps
        steps.append(Step("Is the driver new enough for this build's CUDA?",
                          f"yes: the driver supports CUDA {have[0]}.{have[1]}, the build needs "
                          f"{need[0]}.{need[1]}", True))

    # 4. Is the GPU hidden by CUDA_VISIBLE_DEVICES?
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and (cvd.strip() in ("", "-1", "none", "NoDevFiles")):
        steps.append(Step("Is the GPU hidden by CUDA_VISIBLE_DEVICES?",
                          f"yes: CUDA_VISIBLE_DEVICES={cvd!r} hides every GPU from this process. Unset it "
                          "(and restart the kernel) to use the GPU.", False))
        return steps
    steps.append(Step("Is the GPU hidden by CUDA_VISIBLE_DEVICES?",
                      "no: " + ("it is not set" if cvd is None else f"it is {cvd!r}"), True))

    if not torch_info.cuda_available:
        steps.append(Step("Did CUDA start in this process?",
                          "no: the driver and build look right but CUDA failed to initialise"
                          + (f" ({torch_info.cuda_error})" if torch_info.cuda_error else "")
                          + ". Restart the kernel; if it persists, reboot (a driver update needs one).", False))
    return steps


class EnvironmentReport:
    """A printable report; `str(report)` is the text, `report.device` the chosen device."""

    def __init__(self, lines: list[str], device: torch.device, steps: list[Step]):
        self.lines = lines
        self.device = device
        self.steps = steps

    def __str__(self) -> str:
        return "\n".join(self.lines)

    def __repr__(self) -> str:  # shown as a cell's result in Jupyter
        return str(self)


def describe_environment(torch_info: TorchInfo | None = None, nvml: NvmlInfo | None = None,
                         env: dict | None = None) -> EnvironmentReport:
    """Report torch build, devices, driver and CPU; diagnose when no GPU is usable."""
    faked = torch_info is not None
    t = torch_info or query_torch()
    n = nvml or query_nvml()
    if t.cuda_build:
        build = f"CUDA {t.cuda_build}"
    elif t.hip_build:
        build = f"ROCm/HIP {t.hip_build}"
    else:
        build = "CPU-only"
    lines = [
        f"Python {platform.python_version()} on {platform.system()} {platform.machine()}",
        f"PyTorch {t.version} ({build} build)",
        f"CPU threads used by torch: {torch.get_num_threads()} (logical CPUs: {os.cpu_count()})",
    ]
    if n.available:
        lines.append(f"NVIDIA driver: {n.driver_version or 'unknown'}"
                     + (f" (supports CUDA up to {n.cuda_driver_version[0]}.{n.cuda_driver_version[1]})"
                        if n.cuda_driver_version else ""))
    steps: list[Step] = []
    if t.cuda_available and t.device_count:
        from .memory.sizes import format_bytes  # imported here: the memory package is not needed otherwise

        for i in range(t.device_count):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"GPU {i}: {p.name}, compute capability {p.major}.{p.minor}, "
                         f"{format_bytes(p.total_memory)} total memory")
        device = torch.device("cuda")
    elif t.mps_available:
        lines.append("GPU: Apple MPS (Metal) is available; memory is shared with the CPU")
        device = torch.device("mps")
    else:
        device = torch.device("cpu")
        steps = diagnose(t, n, env)
        lines.append("No GPU is usable in this process. Diagnosis for this machine:")
        for i, s in enumerate(steps, 1):
            lines.append(f"  {i}. {s.question} {s.finding}")
    if not faked:
        device = get_device()  # honours COURSE_DEVICE, so the report names the device notebooks will use
    lines.append(f"The course will use: {device}")
    return EnvironmentReport(lines, device, steps)
