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
    "INTEGRATED_GPUS", "MIN_DRIVER", "EnvironmentReport", "ChecklistItem", "NvmlInfo", "TorchInfo", "build_supports_gpu",
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
    uuids: list[str] = field(default_factory=list)  # "GPU-…" per GPU, in NVML's order (CUDA_VISIBLE_DEVICES may name them)


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
            info.uuids = [d.uuid for d in devices]
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

# The oldest driver for each CUDA major release under which CUDA's minor-version compatibility holds (NVIDIA,
# "CUDA Compatibility" and the toolkit release notes, Linux: 11.x needs 450.80.02, the 450 release CUDA 11.0 came
# with is not enough; 12.x 525.60.13; 13.x the 580 branch). Windows' numbers differ slightly (452.39, 527.41).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580"}


def _release(version: str | None) -> tuple[int, ...] | None:
    """'450.80.02' -> (450, 80, 2); None when it is not a dotted number."""
    parts = (version or "").split(".")
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else None


def driver_runs_build(build: tuple[int, int], driver_cuda: tuple[int, int], driver_version: str | None
                      ) -> tuple[bool, str]:
    """Can a driver that supports CUDA `driver_cuda` run code built with CUDA `build`? (ok, why)

    A driver runs everything built for its CUDA version or older (backward compatibility). Since CUDA 11, it
    also runs code built with a newer *minor* release of its own major release (minor-version compatibility),
    provided the driver is at least that major release's minimum (`MIN_DRIVER`); features that need the newer driver
    (PTX compiled by the newer toolkit) are then unavailable.
    """
    need, have = f"{build[0]}.{build[1]}", f"{driver_cuda[0]}.{driver_cuda[1]}"
    if driver_cuda >= build:
        return True, _("the driver supports CUDA {have}, this build uses CUDA {need}").format(have=have, need=need)
    release = _release(driver_version)
    minimum = MIN_DRIVER.get(build[0])
    new_enough = release is None or minimum is None or release >= _release(minimum)
    if build[0] >= 11 and driver_cuda[0] == build[0] and minimum is not None and new_enough:
        return True, _("the driver supports CUDA {have} and this build uses CUDA {need}: the same major release, "
                       "so CUDA's minor-version compatibility lets it run (features that need a newer driver, such "
                       "as PTX from the newer toolkit, are unavailable)").format(have=have, need=need)
    if not new_enough:
        fix = _("update the driver to {minimum} or newer").format(minimum=minimum)
    else:
        fix = _("update the driver")
    return False, _("the driver supports CUDA up to {have}, but this torch was built with CUDA {need}: {fix}, or "
                    "install a torch build for CUDA {major}.x").format(have=have, need=need, fix=fix,
                                                                       major=driver_cuda[0])


def _arch(name: str) -> tuple[tuple[int, int], str, str] | None:
    """'sm_86' -> ((8, 6), 'sm', ''); 'compute_90' -> ((9, 0), 'compute', ''); 'sm_90a' -> ((9, 0), 'sm', 'a');
    'compute_100f' -> ((10, 0), 'compute', 'f'). 'a' (arch-specific) code runs only on that GPU; 'f' (family) code
    on the GPUs of its family (the same major version, an equal or higher minor one)."""
    kind, _sep, rest = name.partition("_")
    variant = rest[-1] if rest[-1:] in ("a", "f") else ""
    digits = rest[:-1] if variant else rest
    if kind not in ("sm", "compute") or len(digits) < 2 or not digits.isdigit():
        return None
    return (int(digits[:-1]), int(digits[-1])), kind, variant


# The integrated GPUs of NVIDIA's Jetson/Tegra chips (Nano 5.3, TX2 6.2, Xavier 7.2, Orin 8.7, Thor 10.1, renamed
# 11.0) do not share machine code with the discrete GPUs of their major version, either way (PyTorch's table,
# torch.cuda.DEVICE_REQUIREMENT); from CUDA 13.2 on, sm_70, sm_80 and sm_86 code runs on Xavier and Orin too.
INTEGRATED_GPUS = {(5, 3), (6, 2), (7, 2), (8, 7), (10, 1), (11, 0)}
_RENAMED = {(10, 1): (11, 0), (11, 0): (10, 1)}
_UNIFIED = {(7, 0), (8, 0), (8, 6)}  # CUDA 13.2's "SBSA" code that Jetsons run


def _machine_code_runs(code: tuple[int, int], gpu: tuple[int, int], cuda_build: tuple[int, int] | None) -> bool:
    """Does sm_XY machine code built for `code` run on a GPU of capability `gpu`?"""
    if code in INTEGRATED_GPUS or gpu in INTEGRATED_GPUS:
        if code == gpu or _RENAMED.get(code) == gpu:
            return True
        return (cuda_build is not None and cuda_build >= (13, 2) and code in _UNIFIED and gpu[0] == code[0]
                and gpu >= code)
    return code[0] == gpu[0] and code[1] <= gpu[1]  # same major, equal or higher minor


def _ptx_runs(code: tuple[int, int], variant: str, gpu: tuple[int, int]) -> bool:
    """Can the driver compile PTX built for `code` (compute_XY, compute_XYa, compute_XYf) for a GPU of `gpu`?"""
    if variant == "a":
        return code == gpu
    if variant == "f":
        return code[0] == gpu[0] and code <= gpu
    return code <= gpu


def build_supports_gpu(capability: tuple[int, int], arch_list: list[str],
                       cuda_build: tuple[int, int] | None = None) -> tuple[bool, str]:
    """Does this build carry code that runs on a GPU of compute `capability`? (ok, why)

    Machine code (sm_XY) runs on GPUs of the same major version and an equal or higher minor one, except across
    Jetson (integrated) and discrete GPUs (`INTEGRATED_GPUS`; `cuda_build`, the build's CUDA version, decides
    CUDA 13.2's exception); PTX (compute_XY) is compiled by the driver for any GPU of capability XY or higher
    (slowly, on first use). Arch-specific variants (sm_90a, compute_90a) run only on exactly that GPU, family
    variants (sm_100f, compute_100f) on the GPUs of the family.
    """
    cc = f"sm_{capability[0]}{capability[1]}"
    archs = [a for a in (_arch(n) for n in arch_list) if a is not None]
    if any(kind == "sm" and (v == capability if variant == "a" else _machine_code_runs(v, capability, cuda_build))
           for v, kind, variant in archs):
        return True, _("yes: this build has machine code for {cc} GPUs ({archs})").format(cc=cc,
                                                                                          archs=" ".join(arch_list))
    if any(kind == "compute" and _ptx_runs(v, variant, capability) for v, kind, variant in archs):
        return True, _("yes, through PTX: the driver compiles it for {cc} on first use (slow the first time)"
                       ).format(cc=cc)
    listed = " ".join(arch_list) or _("none")
    versions = [v for v, _kind, _variant in archs]
    if capability in INTEGRATED_GPUS:
        return False, _("no: this GPU ({cc}) is a Jetson's integrated GPU, and this build has no code it runs "
                        "({listed}). Install a torch built for Jetson (NVIDIA publishes them for each JetPack "
                        "release)").format(cc=cc, listed=listed)
    if versions and all(v in INTEGRATED_GPUS for v in versions):
        return False, _("no: this build is for Jetson GPUs (it has code for {listed}), and this GPU ({cc}) is not "
                        "one. Install a torch built for desktop and data-center GPUs").format(cc=cc, listed=listed)
    if versions and capability < min(versions):
        return False, _("no: this GPU ({cc}) is too old for this build, which has code for {listed}. Install an "
                        "older torch (or one built for an older CUDA) that still supports it").format(cc=cc,
                                                                                                    listed=listed)
    if not versions or capability > max(versions):
        return False, _("no: this GPU ({cc}) is newer than anything this build has code for ({listed}). Install a "
                        "newer torch built for a newer CUDA (pytorch.org's selector lists them); until then it "
                        "fails with 'no kernel image is available for execution on the device'").format(
            cc=cc, listed=listed)
    return False, _("no: this build has no code that runs on {cc} GPUs, although it has code for older and newer "
                    "ones ({listed}). Install a torch build whose `torch.cuda.get_arch_list()` includes {cc} "
                    "(pytorch.org's selector lists the builds)").format(cc=cc, listed=listed)


def _walk_uuids(named: list[str], uuids: list[str]) -> tuple[list[int], str | None, str]:
    """Match UUID prefixes to GPUs as torch does (`_transform_uuid_to_ordinals`): (the GPUs found, in order; the
    prefix that ended the list, or None; why it ended: 'none' matched, 'several' did, or a GPU named 'twice')."""
    found: list[int] = []
    for prefix in named:
        matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(prefix)]
        if len(matches) != 1:
            return found, prefix, "none" if not matches else "several"
        if matches[0] in found:
            return found, prefix, "twice"
        found.append(matches[0])
    return found, None, ""


def count_visible(value: str, nvml: NvmlInfo) -> int | None:
    """How many of this machine's GPUs a CUDA_VISIBLE_DEVICES value shows (None where it cannot be told: NVML
    listed no GPUs, MIG devices, or GPUs without known UUIDs). Indices count up to the first one this machine does
    not have; UUID prefixes up to the first that matches no GPU or more than one, as in torch.cuda.device_count()."""
    named = nvml_reader.visible_devices(value)
    if not named:
        return 0
    if not nvml.gpus:
        return None
    if isinstance(named[0], int):
        return next((i for i, index in enumerate(named) if index >= len(nvml.gpus)), len(named))
    if named[0].startswith("MIG-") or len(nvml.uuids) != len(nvml.gpus):
        return None
    found, _prefix, why = _walk_uuids(named, nvml.uuids)
    return 0 if why == "twice" else len(found)


def _cuda_version(text: str | None) -> tuple[int, int] | None:
    """'13.0' -> (13, 0); None for a CPU-only build."""
    return tuple(int(p) for p in text.split(".")[:2]) if text else None


@dataclass
class ChecklistItem:
    """One question of the diagnosis, what this machine answered, and whether that answer is fine."""
    question: str
    finding: str
    ok: bool


def diagnose(torch_info: TorchInfo, nvml: NvmlInfo, env: dict | None = None) -> list[ChecklistItem]:
    """The course's checklist for "why is there no GPU?", answered for this machine.

    Pure function of its inputs so every branch can be unit-tested with faked answers.
    Stops adding items after the first one that explains the problem.
    """
    env = dict(os.environ) if env is None else env
    checklist: list[ChecklistItem] = []

    # 1. Is a driver visible?
    if nvml.available:
        gpus = ", ".join(nvml.gpus) if nvml.gpus else _("no GPUs listed")
        checklist.append(ChecklistItem(_("Is an NVIDIA driver visible?"),
                          _("yes: driver {version} ({gpus})").format(version=nvml.driver_version or "?", gpus=gpus),
                          True))
    else:
        checklist.append(ChecklistItem(_("Is an NVIDIA driver visible?"),
                          _("no: NVML could not be loaded ({error}). Either this machine has no NVIDIA GPU, "
                            "or its driver is not installed or not loaded. `nvidia-smi` in a terminal should list "
                            "the GPU; if it does not, install the driver first.").format(error=nvml.error), False))

    # 2. Is this a CPU-only build of torch?
    if torch_info.hip_build:
        checklist.append(ChecklistItem(_("Is this PyTorch build able to use a GPU?"),
                          _("yes: a ROCm (HIP {hip}) build").format(hip=torch_info.hip_build), True))
    elif torch_info.cuda_build is None:
        checklist.append(ChecklistItem(_("Is this PyTorch build able to use a GPU?"),
                          _("no: torch {version} is a CPU-only build (torch.version.cuda is None). "
                            "Reinstall torch with a CUDA build (see the README) if this machine has an NVIDIA GPU."
                            ).format(version=torch_info.version),
                          not nvml.available))
        if nvml.available:
            return checklist
    else:
        checklist.append(ChecklistItem(_("Is this PyTorch build able to use a GPU?"),
                          _("yes: torch {version} was built with CUDA {cuda}").format(version=torch_info.version,
                                                                                   cuda=torch_info.cuda_build), True))

    if not nvml.available:
        return checklist

    # 3. Is the driver new enough for the build's CUDA?
    if torch_info.cuda_build and nvml.cuda_driver_version:
        need = _cuda_version(torch_info.cuda_build)
        ok, why = driver_runs_build(need, nvml.cuda_driver_version, nvml.driver_version)
        checklist.append(ChecklistItem(_("Is the driver new enough for this build's CUDA?"),
                          (_("yes: {why}") if ok else _("no: {why}")).format(why=why), ok))
        if not ok:
            return checklist
    # 4. Does the build have code for this GPU?
    unsupported = gpu_support_problems(torch_info, nvml)
    if unsupported:
        checklist.append(ChecklistItem(_("Does this PyTorch build support this GPU?"), unsupported[0], False))
        return checklist
    if torch_info.arch_list and any(nvml.capabilities):
        checklist.append(ChecklistItem(_("Does this PyTorch build support this GPU?"),
                          build_supports_gpu(next(c for c in nvml.capabilities if c), torch_info.arch_list,
                                             _cuda_version(torch_info.cuda_build))[1], True))
    # 5. Is the GPU hidden by CUDA_VISIBLE_DEVICES?
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    shown = None if cvd is None else count_visible(cvd, nvml)
    if shown == 0:
        checklist.append(ChecklistItem(_("Is the GPU hidden by CUDA_VISIBLE_DEVICES?"),
                          _("yes: CUDA_VISIBLE_DEVICES={value!r} shows none of this machine's {count} GPU(s) "
                            "({why}). Unset it, or name GPUs 0 to {last} or their UUIDs (nvidia-smi -L), and restart "
                            "the kernel.").format(value=cvd, count=len(nvml.gpus), last=max(len(nvml.gpus) - 1, 0),
                                                  why=_hidden_why(cvd, nvml)), False))
        return checklist
    if cvd is None:
        finding = _("no: it is not set")
    elif shown is None:
        finding = _("no: it is {value!r} (which GPUs it names is not checked here: NVML listed no GPUs or no UUIDs, or it "
                    "names MIG slices)").format(value=cvd)
    else:
        finding = _("no: it is {value!r}, which shows {shown} of the {count} GPU(s)").format(
            value=cvd, shown=shown, count=len(nvml.gpus))
    checklist.append(ChecklistItem(_("Is the GPU hidden by CUDA_VISIBLE_DEVICES?"), finding, True))

    if not torch_info.cuda_available:
        if torch_info.cuda_error:
            finding = _("no: the driver and build look right but CUDA failed to initialise ({error}). Restart the "
                        "kernel; if it persists, reboot (a driver update needs one).").format(error=torch_info.cuda_error)
        else:
            finding = _("no: the driver and build look right but CUDA failed to initialise. Restart the kernel; if "
                        "it persists, reboot (a driver update needs one).")
        checklist.append(ChecklistItem(_("Did CUDA start in this process?"), finding, False))
    return checklist


def _hidden_why(value: str, nvml: NvmlInfo) -> str:
    """Why a CUDA_VISIBLE_DEVICES value shows none of the machine's GPUs, in words."""
    named = nvml_reader.visible_devices(value)
    first = value.split(",")[0]
    if not value.strip():
        return _("an empty value hides every GPU")
    if not named and nvml_reader.visible_devices(first):  # the first entry alone names a GPU: a later one repeats it
        return _("a GPU is named twice, which hides every GPU")
    if not named:
        return _("its first entry, {entry!r}, is not a GPU index, and the list ends there").format(entry=first)
    if isinstance(named[0], int):
        return _("GPU {index} does not exist here, and the list ends there").format(index=named[0])
    _found, prefix, why = _walk_uuids(named, nvml.uuids)
    if why == "twice":
        return _("a GPU is named twice, which hides every GPU")
    if why == "several":
        return _("{entry!r} matches more than one GPU's UUID, and the list ends there").format(entry=prefix)
    return _("{entry!r} matches no GPU's UUID, and the list ends there").format(entry=prefix)


def gpu_support_problems(torch_info: TorchInfo, nvml: NvmlInfo) -> list[str]:
    """For each GPU this build has no code for: what is wrong, and the fix (empty when all are supported or
    nothing is known)."""
    if not torch_info.arch_list or torch_info.hip_build:
        return []
    problems = []
    for name, cc in zip(nvml.gpus, nvml.capabilities):
        if cc is not None:
            ok, why = build_supports_gpu(cc, torch_info.arch_list, _cuda_version(torch_info.cuda_build))
            if not ok:
                problems.append(_("{name}: {why}").format(name=name, why=why))
    return problems


class EnvironmentReport:
    """A printable report; `str(report)` is the text, `report.device` the chosen device."""

    def __init__(self, lines: list[str], device: torch.device, checklist: list[ChecklistItem]):
        self.lines = lines
        self.device = device
        self.checklist = checklist

    def __str__(self) -> str:
        return "\n".join(self.lines)

    def __repr__(self) -> str:  # shown as a cell's result in Jupyter
        return str(self)


def cpu_load_line(use: CpuUse) -> str:
    """One line on what other processes do to this course's timings (notebook 04 explains why)."""
    if use.others >= 0.5:
        return _("Busy machine: other processes are using {others:.1f} of the {cpus:g} CPUs right now. Training and "
                 "timing cells will run slower than on a quiet machine and their figures will vary more. Before each "
                 "cell the course gives torch one thread fewer for each core that others hold, which keeps the "
                 "slowdown small; notebook 04, section 6, shows why.").format(
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
    checklist: list[ChecklistItem] = []
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
        checklist = diagnose(t, n, env)
        lines.append(_("No GPU is usable in this process. Diagnosis for this machine:"))
        for i, s in enumerate(checklist, 1):
            lines.append(_("  {number}. {question} {finding}").format(number=i, question=s.question, finding=s.finding))
    if not faked:
        device = get_device()  # honours COURSE_DEVICE, so the report names the device notebooks will use
        lines.append(cpu_load_line(cpu_use(0.5)))
    lines.append(_("The course will use: {device}").format(device=device))
    return EnvironmentReport(lines, device, checklist)
