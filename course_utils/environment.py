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
from .i18n import _
from .device import get_device, mps_available
from .threads import CpuUse, cpu_use

__all__ = [
    "MIN_DRIVER_BRANCH", "EnvironmentReport", "NvmlInfo", "Step", "TorchInfo", "build_supports_gpu",
    "describe_environment", "diagnose", "driver_runs_build", "gpu_support_problems", "query_nvml", "query_torch",
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
    capabilities: list[tuple[int, int] | None] = field(default_factory=list)  # compute capability per GPU


def query_nvml(nvml=None) -> NvmlInfo:
    """Ask NVML (nvidia-ml-py) about the driver and GPUs. Never raises. `nvml`: the binding (default
    `pynvml`), or a stand-in in tests."""
    if nvml is None:
        try:
            nvml = nvml_reader.load()
        except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a dependency
            return NvmlInfo(False, error=_("nvidia-ml-py is not installed ({error})").format(error=exc))
    with nvml_reader.session(nvml) as error:
        if error is not None:
            return NvmlInfo(False, error=error)
        info = NvmlInfo(True, driver_version=nvml_reader.driver_version(nvml),
                        cuda_driver_version=nvml_reader.cuda_driver_version(nvml))
        try:
            devices = nvml_reader.list_devices(nvml, mig=False)
            info.gpus = [nvml_reader.device_name(nvml, d.handle) for d in devices]
            info.capabilities = [nvml_reader.compute_capability(nvml, d.handle) for d in devices]
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
    arch_list: list[str] = field(default_factory=list)  # torch.cuda.get_arch_list(): the GPU code in this build


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
        arch_list=torch.cuda.get_arch_list(),  # compiled in: known without a GPU
    )


# --- compatibility rules ----------------------------------------------------------------

# Minimum driver branch for each CUDA major release, under which CUDA's minor-version compatibility holds
# (NVIDIA, "CUDA Compatibility", minor version compatibility table: 11.x >= 450, 12.x >= 525, 13.x >= 580).
MIN_DRIVER_BRANCH = {11: 450, 12: 525, 13: 580}


def driver_runs_build(build: tuple[int, int], driver_cuda: tuple[int, int], driver_version: str | None
                      ) -> tuple[bool, str]:
    """Can a driver that supports CUDA `driver_cuda` run code built with CUDA `build`? (ok, why)

    A driver runs everything built for its CUDA version or older (backward compatibility). Since CUDA 11, it
    also runs code built with a newer *minor* release of its own major release (minor-version compatibility),
    provided the driver is at least that major release's minimum branch; features that need the newer driver
    (PTX compiled by the newer toolkit) are then unavailable.
    """
    need, have = f"{build[0]}.{build[1]}", f"{driver_cuda[0]}.{driver_cuda[1]}"
    if driver_cuda >= build:
        return True, _("the driver supports CUDA {have}, this build uses CUDA {need}").format(have=have, need=need)
    branch = int(driver_version.split(".")[0]) if driver_version and driver_version.split(".")[0].isdigit() else None
    minimum = MIN_DRIVER_BRANCH.get(build[0])
    if build[0] >= 11 and driver_cuda[0] == build[0] and minimum is not None and (branch is None or branch >= minimum):
        return True, _("the driver supports CUDA {have} and this build uses CUDA {need}: the same major release, "
                       "so CUDA's minor-version compatibility lets it run (features that need a newer driver, such "
                       "as PTX from the newer toolkit, are unavailable)").format(have=have, need=need)
    if minimum is not None and branch is not None and branch < minimum:
        fix = _("update the driver to the {minimum} branch or newer").format(minimum=minimum)
    else:
        fix = _("update the driver")
    return False, _("the driver supports CUDA up to {have}, but this torch was built with CUDA {need}: {fix}, or "
                    "install a torch build for CUDA {major}.x").format(have=have, need=need, fix=fix,
                                                                       major=driver_cuda[0])


def _arch(name: str) -> tuple[tuple[int, int], str] | None:
    """'sm_86' -> ((8, 6), 'sm'); 'compute_90' -> ((9, 0), 'compute'); 'sm_90a' -> ((9, 0), 'sm_a');
    'sm_100f' -> ((10, 0), 'sm')."""
    kind, _sep, rest = name.partition("_")
    digits = rest.rstrip("af")
    if kind not in ("sm", "compute") or len(digits) < 2 or not digits.isdigit():
        return None
    # 'a' (arch-specific) code runs only on that GPU; 'f' (family) code on the family, like plain sm code
    return (int(digits[:-1]), int(digits[-1])), kind + ("_a" if rest.endswith("a") else "")


def build_supports_gpu(capability: tuple[int, int], arch_list: list[str]) -> tuple[bool, str]:
    """Does this build carry code that runs on a GPU of compute `capability`? (ok, why)

    Machine code (sm_XY) runs on GPUs of the same major version and an equal or higher minor one; PTX
    (compute_XY) is compiled by the driver for any GPU of capability XY or higher (slowly, on first use).
    Arch-specific variants (sm_90a) run only on exactly that GPU.
    """
    cc = f"sm_{capability[0]}{capability[1]}"
    archs = [a for a in (_arch(n) for n in arch_list) if a is not None]
    sms = sorted(v for v, kind in archs if kind == "sm")
    if any((v[0] == capability[0] and v[1] <= capability[1]) if kind == "sm" else v == capability
           for v, kind in archs if kind in ("sm", "sm_a")):
        return True, _("yes: this build has machine code for {cc} GPUs ({archs})").format(cc=cc,
                                                                                          archs=" ".join(arch_list))
    if any(kind == "compute" and v <= capability for v, kind in archs):
        return True, _("yes, through PTX: the driver compiles it for {cc} on first use (slow the first time)"
                       ).format(cc=cc)
    listed = " ".join(arch_list) or _("none")
    if sms and capability < sms[0]:
        return False, _("no: this GPU ({cc}) is too old for this build, which has code for {listed}. Install an "
                        "older torch (or one built for an older CUDA) that still supports it").format(cc=cc,
                                                                                                    listed=listed)
    return False, _("no: this GPU ({cc}) is newer than anything this build has code for ({listed}). Install a "
                    "newer torch built for a newer CUDA (pytorch.org's selector lists them); until then it fails "
                    "with 'no kernel image is available for execution on the device'").format(cc=cc, listed=listed)


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
        gpus = ", ".join(nvml.gpus) if nvml.gpus else _("no GPUs listed")
        steps.append(Step(_("Is an NVIDIA driver visible?"),
                          _("yes: driver {version} ({gpus})").format(version=nvml.driver_version or "?", gpus=gpus),
                          True))
    else:
        steps.append(Step(_("Is an NVIDIA driver visible?"),
                          _("no: NVML could not be loaded ({error}). Either this machine has no NVIDIA GPU, "
                            "or its driver is not installed or not loaded. `nvidia-smi` in a terminal should list "
                            "the GPU; if it does not, install the driver first.").format(error=nvml.error), False))

    # 2. Is this a CPU-only build of torch?
    if torch_info.hip_build:
        steps.append(Step(_("Is this PyTorch build able to use a GPU?"),
                          _("yes: a ROCm (HIP {hip}) build").format(hip=torch_info.hip_build), True))
    elif torch_info.cuda_build is None:
        steps.append(Step(_("Is this PyTorch build able to use a GPU?"),
                          _("no: torch {version} is a CPU-only build (torch.version.cuda is None). "
                            "Reinstall torch with a CUDA build (see the README) if this machine has an NVIDIA GPU."
                            ).format(version=torch_info.version),
                          not nvml.available))
        if nvml.available:
            return steps
    else:
        steps.append(Step(_("Is this PyTorch build able to use a GPU?"),
                          _("yes: torch {version} was built with CUDA {cuda}").format(version=torch_info.version,
                                                                                   cuda=torch_info.cuda_build), True))

    if not nvml.available:
        return steps

    # 3. Is the driver new enough for the build's CUDA?
    if torch_info.cuda_build and nvml.cuda_driver_version:
        need = tuple(int(p) for p in torch_info.cuda_build.split(".")[:2])
        ok, why = driver_runs_build(need, nvml.cuda_driver_version, nvml.driver_version)
        steps.append(Step(_("Is the driver new enough for this build's CUDA?"),
                          (_("yes: {why}") if ok else _("no: {why}")).format(why=why), ok))
        if not ok:
            return steps
    # 4. Does the build have code for this GPU?
    unsupported = gpu_support_problems(torch_info, nvml)
    if unsupported:
        steps.append(Step(_("Does this PyTorch build support this GPU?"), unsupported[0], False))
        return steps
    if torch_info.arch_list and any(nvml.capabilities):
        steps.append(Step(_("Does this PyTorch build support this GPU?"),
                          build_supports_gpu(next(c for c in nvml.capabilities if c), torch_info.arch_list)[1], True))
    # 5. Is the GPU hidden by CUDA_VISIBLE_DEVICES?
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and (cvd.strip() in ("", "-1", "none", "NoDevFiles")):
        steps.append(Step(_("Is the GPU hidden by CUDA_VISIBLE_DEVICES?"),
                          _("yes: CUDA_VISIBLE_DEVICES={value!r} hides every GPU from this process. Unset it "
                            "(and restart the kernel) to use the GPU.").format(value=cvd), False))
        return steps
    steps.append(Step(_("Is the GPU hidden by CUDA_VISIBLE_DEVICES?"),
                      _("no: it is not set") if cvd is None else _("no: it is {value!r}").format(value=cvd), True))

    if not torch_info.cuda_available:
        if torch_info.cuda_error:
            finding = _("no: the driver and build look right but CUDA failed to initialise ({error}). Restart the "
                        "kernel; if it persists, reboot (a driver update needs one).").format(error=torch_info.cuda_error)
        else:
            finding = _("no: the driver and build look right but CUDA failed to initialise. Restart the kernel; if "
                        "it persists, reboot (a driver update needs one).")
        steps.append(Step(_("Did CUDA start in this process?"), finding, False))
    return steps


def gpu_support_problems(torch_info: TorchInfo, nvml: NvmlInfo) -> list[str]:
    """For each GPU this build has no code for: what is wrong, and the fix (empty when all are supported or
    nothing is known)."""
    if not torch_info.arch_list or torch_info.hip_build:
        return []
    problems = []
    for name, cc in zip(nvml.gpus, nvml.capabilities):
        if cc is not None:
            ok, why = build_supports_gpu(cc, torch_info.arch_list)
            if not ok:
                problems.append(_("{name}: {why}").format(name=name, why=why))
    return problems


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


def cpu_load_line(use: CpuUse) -> str:
    """One line on what other processes do to this course's timings (notebook 04 explains why)."""
    if use.others >= 0.5:
        return _("Busy machine: other processes are using {others:.1f} of the {cpus:g} CPUs right now. Training and "
                 "timing cells will run slower than on a quiet machine (twice as long is usual when one of two cores "
                 "is taken) and their figures will vary more; notebook 04, section 8, shows why.").format(
            others=use.others, cpus=use.cpus)
    return _("Other processes are using {others:.1f} of the {cpus:g} CPUs: a quiet machine, so this course's "
             "timings will be representative.").format(others=use.others, cpus=use.cpus)


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
        build = _("CPU-only")
    lines = [
        _("Python {python} on {system} {machine}").format(python=platform.python_version(), system=platform.system(),
                                                          machine=platform.machine()),
        _("PyTorch {version} ({build} build)").format(version=t.version, build=build),
        _("CPU threads used by torch: {threads} (logical CPUs: {cpus})").format(threads=torch.get_num_threads(),
                                                                               cpus=os.cpu_count()),
    ]
    if n.available:
        version = n.driver_version or _("unknown")
        if n.cuda_driver_version:
            lines.append(_("NVIDIA driver: {version} (supports CUDA up to {cuda})").format(
                version=version, cuda=f"{n.cuda_driver_version[0]}.{n.cuda_driver_version[1]}"))
        else:
            lines.append(_("NVIDIA driver: {version}").format(version=version))
    steps: list[Step] = []
    if t.cuda_available and t.device_count:
        from .memory.sizes import format_bytes  # imported here: the memory package is not needed otherwise

        for i in range(t.device_count):
            p = torch.cuda.get_device_properties(i)
            lines.append(_("GPU {index}: {name}, compute capability {major}.{minor}, {memory} total memory").format(
                index=i, name=p.name, major=p.major, minor=p.minor, memory=format_bytes(p.total_memory)))
        for problem in gpu_support_problems(t, n):
            lines.append(_("Warning: CUDA starts, but {problem}.").format(problem=problem))
        device = torch.device("cuda")
    elif t.mps_available:
        lines.append(_("GPU: Apple MPS (Metal) is available; memory is shared with the CPU"))
        device = torch.device("mps")
    else:
        device = torch.device("cpu")
        steps = diagnose(t, n, env)
        lines.append(_("No GPU is usable in this process. Diagnosis for this machine:"))
        for i, s in enumerate(steps, 1):
            lines.append(_("  {number}. {question} {finding}").format(number=i, question=s.question, finding=s.finding))
    if not faked:
        device = get_device()  # honours COURSE_DEVICE, so the report names the device notebooks will use
        lines.append(cpu_load_line(cpu_use(0.5)))
    lines.append(_("The course will use: {device}").format(device=device))
    return EnvironmentReport(lines, device, steps)
