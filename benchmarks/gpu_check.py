"""Record the reference GPU figures the notebooks show, and check that every notebook runs on a GPU.

    benchmarks/gpu_check.sh                                      # on a CUDA machine: under 8 minutes
    GPU_CHECK_ALLOW_CPU=1 benchmarks/gpu_check.sh --output x.json  # dry run on the CPU: every code path, tiny sizes

Writes `benchmarks/results/gpu_reference.json` in the format `course_utils.reference` reads,

    {"stamp": stamp("cuda"), "sections": {"matmul": {...}, "cpu_vs_gpu": {...}, ...},
     "notebooks": {"03_devices": "ok" or what failed}, "notebook_seconds": {...}, "errors": {...}}

and copies it to $OUT when that variable is set (executed notebooks go to $OUT/executed/). The file is
rewritten after every section and every notebook, so a run cut short keeps what it measured; sections
of an earlier run on the same hardware are kept unless measured again.

Adding a section: write `def my_section(ctx: Context) -> dict` returning JSON-able figures, decorate it
with `@section("name")`. Sections run in the order they are defined; one that fails is recorded under
"errors" and the others still run. `--only name ...` runs just those.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from course_utils import speed
from course_utils.data import TensorLoader, synthetic_cifar, synthetic_digits
from course_utils.models import SimpleCNN
from course_utils.reference import REFERENCE_FILE
from course_utils.timing import hardware_name, measure, stamp, synchronize

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET_S = 450  # the whole check, notebooks included, must end within 8 minutes


@dataclass(frozen=True)
class Sizes:
    matmul: tuple[int, ...]
    timing_n: int                # matrix size for the launch-versus-work timing
    gpu_batch_sizes: tuple[int, ...]
    cpu_batch_sizes: tuple[int, ...]
    gpu_train: dict              # images / repeats / warmup_steps for speed.train_throughput on the device
    cpu_train: dict              # the same on the CPU
    data_n: int                  # CIFAR-shaped images generated for the training measurements
    compile_backend: str
    transfer_shape: tuple[int, ...]
    setup_steps: int             # notebook 00's training run
    min_notebook_s: float        # do not start a notebook with less time left than this
    batch_size: int | None = None  # replaces every rung's batch size (the dry run: tiny steps)


FULL = Sizes(matmul=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096), timing_n=4096,
             gpu_batch_sizes=(16, 64, 256, 1024), cpu_batch_sizes=(16, 64, 256),
             gpu_train=dict(images=4096, repeats=5, warmup_steps=5),
             cpu_train=dict(images=512, repeats=3, warmup_steps=2),
             data_n=4096, compile_backend="inductor", transfer_shape=(64, 3, 224, 224), setup_steps=200,
             min_notebook_s=45)
# The dry run: every code path on the CPU in seconds. "eager" still goes through torch.compile and Dynamo.
DRY = Sizes(matmul=(16, 32), timing_n=64, gpu_batch_sizes=(2, 4), cpu_batch_sizes=(2, 4),
            gpu_train=dict(images=4, repeats=1, warmup_steps=1), cpu_train=dict(images=4, repeats=1, warmup_steps=1),
            data_n=64, compile_backend="eager", transfer_shape=(2, 3, 8, 8), setup_steps=3, min_notebook_s=0,
            batch_size=4)


@dataclass
class Context:
    device: torch.device
    sizes: Sizes
    dry_run: bool
    _cifar: object = field(default=None, repr=False)

    @property
    def cifar(self):
        """CIFAR-shaped synthetic data shared by the training sections (generated once)."""
        if self._cifar is None:
            self._cifar = synthetic_cifar(self.sizes.data_n, seed=0)
        return self._cifar


SECTIONS: dict[str, Callable[[Context], dict]] = {}


def section(name: str):
    """Register `fn(ctx) -> dict` as the reference section `name` (see the module docstring)."""
    def register(fn):
        if name in SECTIONS:
            raise ValueError(f"section {name!r} defined twice")
        SECTIONS[name] = fn
        return fn
    return register


# --- sections ---------------------------------------------------------------------------------

@section("matmul")
def matmul(ctx: Context) -> dict:
    """Notebooks 00 and 04: matrix-product throughput against size, the crossover, launch versus work."""
    sizes = list(ctx.sizes.matmul)
    cpu = speed.matmul_sweep(sizes, "cpu")
    gpu = speed.matmul_sweep(sizes, ctx.device)
    gpu_copies = speed.matmul_sweep(sizes, ctx.device, include_transfer=True)
    n = ctx.sizes.timing_n
    a = torch.randn(n, n, device=ctx.device)
    launch_s, total_s = speed.launch_and_total_seconds(lambda: a @ a, ctx.device)
    return {"sizes": sizes, "cpu_gflops": [cpu[s] for s in sizes], "gpu_gflops": [gpu[s] for s in sizes],
            "gpu_with_transfer_gflops": [gpu_copies[s] for s in sizes],
            "crossover_n": speed.crossover(cpu, gpu_copies), "timing_n": n,
            "launch_us": launch_s * 1e6, "synced_us": total_s * 1e6,
            "float32_matmul_precision": torch.get_float32_matmul_precision(), "cpu": hardware_name("cpu")}


@section("cpu_vs_gpu")
def cpu_vs_gpu(ctx: Context) -> dict:
    """Notebook 04: the article's loop (speed.naive) and the resident-data loop, on this CPU and on the GPU."""
    s = ctx.sizes
    bs = {"batch_size": s.batch_size}
    cpu_naive = speed.naive("cpu", ctx.cifar, **s.cpu_train, **bs)
    gpu_naive = speed.naive(ctx.device, ctx.cifar, **s.gpu_train, **bs)
    cpu_resident = speed.resident_data("cpu", ctx.cifar, **s.cpu_train, **bs)
    gpu_resident = speed.resident_data(ctx.device, ctx.cifar, **s.gpu_train, **bs)
    return {"cpu_naive_images_per_s": cpu_naive, "gpu_naive_images_per_s": gpu_naive,
            "naive_ratio": gpu_naive / cpu_naive,
            "cpu_resident_images_per_s": cpu_resident, "gpu_resident_images_per_s": gpu_resident,
            "resident_ratio": gpu_resident / cpu_resident,
            "article_ratio": (17 * 60 + 42) / (60 + 26), "cpu": hardware_name("cpu")}


@section("batch_size")
def batch_size(ctx: Context) -> dict:
    """Notebook 04: training images/s against batch size, data resident on each device."""
    s = ctx.sizes
    gpu = speed.batch_size_sweep(ctx.device, ctx.cifar, s.gpu_batch_sizes, **s.gpu_train)
    cpu = speed.batch_size_sweep("cpu", ctx.cifar, s.cpu_batch_sizes, **s.cpu_train)
    return {"gpu_images_per_s": {str(k): v for k, v in gpu.items()},
            "cpu_images_per_s": {str(k): v for k, v in cpu.items()}}


@section("speed_ladder")
def speed_ladder(ctx: Context) -> dict:
    """Notebook 04: every rung, torch.compile included, on the GPU; each rung's MFU against the peak measured
    here (the best matrix product or CifarCNN convolution) in the precision it computes in (float32, TF32,
    bf16/fp16)."""
    result = speed.run_ladder(ctx.device, ctx.cifar, include_compile=True, compile_backend=ctx.sizes.compile_backend,
                              batch_size=ctx.sizes.batch_size, **ctx.sizes.gpu_train)
    figures = result.to_dict()
    measured = {speed.rung_precision(r.config, ctx.device) for r in speed.RUNGS if r.name in result.images_per_s}
    precisions = [p for p in speed.PRECISIONS if p in measured]
    conv_batches = (ctx.sizes.batch_size,) if ctx.sizes.batch_size else (64, 256)
    peaks = {p: max([*speed.matmul_peak_sweep(ctx.sizes.matmul, ctx.device, p).values(),
                     *speed.conv_sweep(ctx.device, p, conv_batches).values()]) for p in precisions}
    figures["peak_gflops"] = peaks
    figures["mfu"] = speed.ladder_mfu(result.images_per_s, peaks, ctx.device)
    return figures


@section("transfers")
def transfers(ctx: Context) -> dict:
    """Notebook 03: host-to-device copies from pageable and pinned memory; reading a non_blocking D2H copy early."""
    dev = ctx.device
    host = torch.rand(*ctx.sizes.transfer_shape)
    pinned = host.pin_memory() if dev.type == "cuda" else host  # pinning needs CUDA (the dry run copies unpinned)
    nbytes = host.numel() * host.element_size()

    def gbps(src: torch.Tensor) -> float:
        m = measure(lambda: src.to(dev, non_blocking=True), device=dev, warmup=2, repeats=7)
        return nbytes / m.median / 1e9

    n = ctx.sizes.timing_n
    a = torch.ones(n, n, device=dev)
    product = a @ a
    early = product.to("cpu", non_blocking=True)
    read_before = early[-1, -1].item()  # deliberately before synchronizing: the pitfall notebook 03 describes
    synchronize(dev)
    return {"copy_mb": nbytes / 1e6, "pageable_gbps": gbps(host), "pinned_gbps": gbps(pinned),
            "pinned": dev.type == "cuda", "d2h_read_before_sync": read_before,
            "d2h_read_after_sync": early[-1, -1].item(), "d2h_expected": float(n)}


@section("setup_training")
def setup_training(ctx: Context) -> dict:
    """Notebook 00: SimpleCNN + Adam on synthetic digits, batch 64, data resident, as its training cell runs it."""
    dev = ctx.device
    steps = ctx.sizes.setup_steps
    torch.manual_seed(0)
    data = synthetic_digits(max(64 * (steps + 10), 640), seed=0)
    model = SimpleCNN().to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    loader = TensorLoader.from_dataset(data, batch_size=64, device=dev)

    def run(max_steps: int) -> torch.Tensor:
        total = torch.zeros((), device=dev)
        for i, (x, y) in enumerate(loader):
            if i == max_steps:
                break
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.detach()
        return total

    run(10)  # warm-up
    synchronize(dev)
    t0 = time.perf_counter()
    run(steps).item()  # CPU-GPU sync point: waits for every queued step
    seconds = time.perf_counter() - t0
    return {"images_per_s": steps * 64 / seconds, "steps": steps, "batch_size": 64}


def _sibling(name: str):
    """Import benchmarks/<name>.py, next to this script, however this script was loaded."""
    spec = importlib.util.spec_from_file_location(f"_gpu_check_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module


@section("amp")
def amp(ctx: Context) -> dict:
    """Notebook 06: mixed-precision step time and peak memory per mode (benchmarks/gpu_amp.py)."""
    return _sibling("gpu_amp").run(ctx.device, quick=ctx.dry_run)


@section("memory")
def memory(ctx: Context) -> dict:
    """Notebook 05: estimator vs allocator, allocated/reserved around empty_cache, OOM recovery (gpu_memory.py)."""
    return _sibling("gpu_memory").run(ctx.device, quick=ctx.dry_run)


@section("ddp")
def ddp(ctx: Context) -> dict:
    """Notebook 08: all-reduce cost and DDP step overhead with NCCL, one process per GPU (needs 2+ GPUs; the dry
    run uses 2 CPU processes on gloo)."""
    import json
    import os
    import subprocess
    import tempfile

    gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    if gpus < 2 and not ctx.dry_run:
        return {"skipped": f"needs 2 or more GPUs, this machine has {gpus}"}
    nproc = min(gpus, 8) if gpus >= 2 else 2
    quick = ["--sizes", "1000,100000", "--repeats", "2", "--rounds", "1", "--steps", "1"] if ctx.dry_run else []
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "ddp.json"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if ctx.dry_run:
            env["CUDA_VISIBLE_DEVICES"] = ""
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={nproc}", "-m", "course_utils.examples.allreduce_cost",
                              "--out", str(out), *quick], capture_output=True, text=True, timeout=600, env=env)
        if run.returncode != 0:
            raise RuntimeError(f"torchrun failed: {run.stderr.strip().splitlines()[-1] if run.stderr else run.returncode}")
        return json.loads(out.read_text())


@section("monitor")
def monitor(ctx: Context) -> dict:
    """Notebooks 00 and 07: which NVML fields this GPU reports, and that the monitor sees allocations."""
    import dataclasses

    from course_utils.monitor import Sampler

    dev = ctx.device
    if dev.type == "cuda":
        torch.cuda.init()
    sampler = Sampler(device=dev.index if dev.type == "cuda" else None)
    before = sampler.sample()
    nbytes = (1 << 20) if ctx.dry_run else (1 << 30)
    block = torch.empty(nbytes // 4, device=dev)  # float32: nbytes of device memory
    synchronize(dev)
    during = sampler.sample()
    del block
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    after = sampler.sample()

    def torch_bytes(snap, field_name):
        return getattr(snap.torch, field_name) if snap.torch is not None else None

    result = {
        "nvml_fields": ({f.name: getattr(during.gpu, f.name) is not None for f in dataclasses.fields(during.gpu)}
                        if during.gpu is not None else None),
        "gpu": dataclasses.asdict(during.gpu) if during.gpu is not None else None,
        "allocated_before": torch_bytes(before, "allocated"),
        "allocated_during": torch_bytes(during, "allocated"),
        "allocated_after": torch_bytes(after, "allocated"),
        "reserved_after_empty_cache": torch_bytes(after, "reserved"),
        "notes": list(during.notes),
    }
    if dev.type == "cuda":
        # what must hold on a GPU: the allocator figures rise by the tensor's size and fall back after del
        result["allocation_seen"] = (result["allocated_during"] - result["allocated_before"]) >= nbytes
        result["release_seen"] = result["allocated_after"] <= result["allocated_before"]
        if not (result["allocation_seen"] and result["release_seen"]):
            raise AssertionError(f"the monitor did not see a {nbytes} byte allocation come and go: {result}")
    return result


# --- running ----------------------------------------------------------------------------------

def _error_text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:400] if lines else ''}".strip()


def run_sections(ctx: Context, names, report: dict, save: Callable[[], None]) -> None:
    """Run the named sections into report["sections"] (failures into report["errors"]), saving after each."""
    for name in names:
        t0 = time.perf_counter()
        try:
            report["sections"][name] = SECTIONS[name](ctx)
            report["errors"].pop(name, None)
            print(f"[gpu_check] section {name}: done in {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as exc:  # one broken section must not cost the others their figures
            report["errors"][name] = _error_text(exc)
            print(f"[gpu_check] section {name}: FAILED: {report['errors'][name]}", flush=True)
            traceback.print_exc()
        save()


def notebook_status(nb) -> str:
    """"ok", or the failing cells of an executed notebook (cells marked NBVAL_RAISES_EXCEPTION may raise)."""
    failures = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or "NBVAL_RAISES_EXCEPTION" in cell.source:
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                value = str(out.get("evalue", "")).strip().splitlines()
                failures.append(f"cell {i}: {out.get('ename')}: {value[0][:300] if value else ''}")
    if not failures:
        return "ok"
    more = f" (+{len(failures) - 3} more)" if len(failures) > 3 else ""
    return "; ".join(failures[:3]) + more


def run_notebooks(paths, executed_dir: Path, deadline: float, sizes: Sizes, cell_timeout: float,
                  report: dict, save: Callable[[], None]) -> None:
    """Execute copies of the notebooks (the originals are never written) with a per-cell timeout."""
    import nbformat
    from nbclient import NotebookClient

    executed_dir.mkdir(parents=True, exist_ok=True)
    for path in paths:
        left = deadline - time.monotonic()
        if left < max(sizes.min_notebook_s, 1):
            report["notebooks"][path.stem] = "skipped: the check's time budget ran out"
            save()
            continue
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(nb, timeout=int(max(10, min(cell_timeout, left))), kernel_name="python3",
                                allow_errors=True, interrupt_on_timeout=True,
                                resources={"metadata": {"path": str(path.parent)}})
        t0 = time.perf_counter()
        try:
            client.execute()
            status = notebook_status(nb)
        except Exception as exc:  # kernel died, could not start, ...
            status = _error_text(exc)
        seconds = time.perf_counter() - t0
        nbformat.write(nb, executed_dir / path.name)
        report["notebooks"][path.stem] = status
        report["notebook_seconds"][path.stem] = round(seconds, 1)
        print(f"[gpu_check] notebook {path.stem}: {status} ({seconds:.0f} s)", flush=True)
        save()


def _load_previous(path: Path, current_stamp: dict) -> dict:
    """An earlier report at `path` measured on the same hardware (its sections are kept), else a fresh one."""
    fresh = {"stamp": current_stamp, "sections": {}, "notebooks": {}, "notebook_seconds": {}, "errors": {}}
    try:
        previous = json.loads(path.read_text())
    except (OSError, ValueError):
        return fresh
    if not isinstance(previous, dict) or previous.get("stamp", {}).get("hardware") != current_stamp["hardware"]:
        return fresh
    for key in ("sections", "notebooks", "notebook_seconds", "errors"):
        if isinstance(previous.get(key), dict):
            fresh[key].update(previous[key])
    return fresh


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, help=f"results file (default: {REFERENCE_FILE.relative_to(ROOT)})")
    parser.add_argument("--notebooks", type=Path, default=ROOT / "notebooks",
                        help="folder of NN_*.ipynb notebooks to execute (default: notebooks/)")
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS), help="run only these sections")
    parser.add_argument("--skip-notebooks", action="store_true", help="measure only, execute no notebook")
    parser.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET_S", DEFAULT_BUDGET_S)),
                        help="seconds for the whole check; notebooks not started in time are reported as skipped")
    parser.add_argument("--cell-timeout", type=float, default=300, help="seconds one notebook cell may take")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.budget

    allow_cpu = os.environ.get("GPU_CHECK_ALLOW_CPU") == "1"
    if torch.cuda.is_available():
        device, sizes, dry_run = torch.device("cuda"), FULL, False
    elif allow_cpu:
        device, sizes, dry_run = torch.device("cpu"), DRY, True
    else:
        print("gpu_check: no CUDA GPU is usable here (torch.cuda.is_available() is False), so there is nothing to "
              "record. On a CPU, GPU_CHECK_ALLOW_CPU=1 runs a dry run with tiny sizes.", file=sys.stderr)
        return 2
    output = args.output or (REFERENCE_FILE if not dry_run
                             else Path(tempfile.gettempdir()) / "gpu_reference.dryrun.json")
    if dry_run and output.resolve() == REFERENCE_FILE.resolve():
        print("gpu_check: a dry run must not write CPU figures into the GPU reference file; pass another --output",
              file=sys.stderr)
        return 2

    report = _load_previous(output, stamp(device))
    report["dry_run"] = dry_run
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None

    def save() -> None:
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = output.with_name(output.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
        os.replace(tmp, output)
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(output, out_dir / output.name)

    print(f"[gpu_check] {'dry run on the CPU' if dry_run else 'GPU check'}: {report['stamp']['hardware']}, "
          f"torch {torch.__version__}; writing {output}", flush=True)
    run_sections(Context(device, sizes, dry_run), args.only or list(SECTIONS), report, save)
    if not args.skip_notebooks:
        paths = sorted(args.notebooks.glob("[0-9][0-9]_*.ipynb"))
        executed = (out_dir / "executed") if out_dir is not None else Path(tempfile.mkdtemp(prefix="gpu_check_"))
        run_notebooks(paths, executed, deadline, sizes, args.cell_timeout, report, save)
        print(f"[gpu_check] executed copies of the notebooks are in {executed}", flush=True)
    save()
    failed = [name for name, status in report["notebooks"].items() if status != "ok"]
    print(f"[gpu_check] sections with errors: {sorted(report['errors']) or 'none'}; "
          f"notebooks not ok: {failed or 'none'}", flush=True)
    return 1 if report["errors"] or failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
