"""fp32 vs autocast: training-step time and peak memory for SimpleCNN and CifarCNN on one device.

    python benchmarks/bench_amp.py                  # the course's device (get_device())
    python benchmarks/bench_amp.py --device cpu --dtypes fp32 bf16 fp16 --repeats 5

Each step is `course_utils.amp.train_step` (zero_grad, autocast forward + loss, backward, step) on a
fixed batch already on the device, so only the step is timed. Modes are timed interleaved
(fp32, bf16, fp32, bf16, ...) so load drift hits them alike; medians are reported, and ratios are
fp32 time / mode time (above 1: the mode is faster), both of medians and, more robust to drift,
the median of per-round ratios ("paired"). Peak memory, measured in a separate untimed step
and reported as the peak above what was allocated before it (activations, gradients, temporaries,
autocast's low-precision weight copies): torch.cuda.max_memory_allocated on CUDA;
course_utils.memory.SimulatedGPU's count on the CPU; not measured on MPS. Results go to benchmarks/results/amp_<device>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from course_utils.amp import MixedPrecision, choose_dtype, train_step  # noqa: E402
from course_utils.device import get_device  # noqa: E402
from course_utils.models import CifarCNN, SimpleCNN  # noqa: E402
from course_utils.timing import format_seconds, measure_interleaved, stamp  # noqa: E402

try:  # counts CPU memory the way a GPU would; optional
    from course_utils.memory import SimulatedGPU
except ImportError:
    SimulatedGPU = None

MODELS = {"SimpleCNN": (SimpleCNN, (1, 28, 28)), "CifarCNN": (CifarCNN, (3, 32, 32))}


def default_dtypes(device: torch.device) -> list[str]:
    """fp32 and the course's choice; on CUDA fp16 too (on CPU fp16 has no fast kernels: opt in)."""
    names = ["fp32", "bf16" if choose_dtype(device) == torch.bfloat16 else "fp16"]
    if device.type == "cuda" and "fp16" not in names:
        names.append("fp16")
    return names


def make_step(model_cls, shape, batch: int, device: torch.device, dtype: str):
    """A closure running one training step of a fresh model in `dtype`, plus its MixedPrecision."""
    torch.manual_seed(0)
    model = model_cls().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    precision = MixedPrecision(device, dtype)
    x = torch.rand(batch, *shape, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step() -> torch.Tensor:
        return train_step(model, opt, F.cross_entropy, x, y, precision)

    step.model, step.optimizer = model, opt  # for the CPU memory count
    return step, precision


def peak_step_bytes(step, device: torch.device) -> int | None:
    """Peak memory a (warmed-up) step allocates above what was live before it.

    CUDA: torch.cuda.max_memory_allocated. CPU: counted by course_utils.memory.SimulatedGPU (live
    tensor storages, rounded like CUDA's allocator; slows the step, so it is not timed). Else None.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    if device.type == "cpu" and SimulatedGPU is not None:
        with SimulatedGPU("1TiB", model=step.model, optimizer=step.optimizer) as gpu:  # counts, never OOMs
            base = gpu.memory_allocated()
            gpu.reset_peak_memory_stats()
            step()
            return gpu.max_memory_allocated() - base
    return None


def run(device: torch.device, dtypes: list[str], batch: int, repeats: int, warmup: int) -> dict:
    results = {}
    for name, (model_cls, shape) in MODELS.items():
        steps, rows = {}, {}
        for dtype in dtypes:
            steps[dtype], precision = make_step(model_cls, shape, batch, device, dtype)
            rows[dtype] = {"dtype": str(precision.dtype).removeprefix("torch."),
                           "grad_scaler": precision.scaler is not None}
        timed = measure_interleaved(steps, device=device, warmup=warmup, repeats=repeats)
        ref = timed[dtypes[0]]
        for dtype in dtypes:
            m = timed[dtype]
            is_fp32_ref = dtypes[0] == "fp32"
            # paired: median over rounds of (fp32 time / this time) in the same round; robust to drift
            paired = statistics.median(a / b for a, b in zip(ref.times, m.times)) if is_fp32_ref else None
            rows[dtype].update(median_s=m.median, iqr_s=m.iqr, times_s=m.times,
                               speedup_vs_fp32=ref.median / m.median if is_fp32_ref else None,
                               paired_speedup_vs_fp32=paired,
                               peak_step_bytes=peak_step_bytes(steps[dtype], device))
        if dtypes[0] == "fp32" and rows["fp32"]["peak_step_bytes"]:
            for dtype in dtypes:
                rows[dtype]["memory_ratio_vs_fp32"] = rows[dtype]["peak_step_bytes"] / rows["fp32"]["peak_step_bytes"]
        results[name] = rows
        print(f"{name} (batch {batch}):")
        for dtype, r in rows.items():
            mem = f", peak {r['peak_step_bytes'] / 2**20:.1f} MiB" if r["peak_step_bytes"] is not None else ""
            ratio = (f", fp32/this {r['speedup_vs_fp32']:.2f}x (paired {r['paired_speedup_vs_fp32']:.2f}x)"
                     if r["speedup_vs_fp32"] is not None else "")
            mratio = f", memory {r['memory_ratio_vs_fp32']:.2f}x of fp32" if "memory_ratio_vs_fp32" in r else ""
            print(f"  {dtype:>4}: median {format_seconds(r['median_s'])} (IQR {format_seconds(r['iqr_s'])})"
                  f"{ratio}{mem}{mratio}")
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cpu, cuda, mps (default: get_device())")
    ap.add_argument("--dtypes", nargs="+", default=None, help="modes to time, fp32 first (default: per device)")
    ap.add_argument("--batch", type=int, default=None, help="default 64 on CPU, 256 on a GPU")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per mode (default 10 CPU, 50 GPU)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/amp_<device>.json)")
    args = ap.parse_args(argv)

    device = get_device(args.device)
    gpu = device.type != "cpu"
    dtypes = args.dtypes or default_dtypes(device)
    batch = args.batch or (256 if gpu else 64)
    repeats = args.repeats or (50 if gpu else 10)
    info = stamp(device)
    print(f"AMP benchmark on {info['hardware']}, torch {info['torch']}, modes {dtypes}")
    results = run(device, dtypes, batch, repeats, args.warmup)
    if device.type != "cuda":
        print("(peak memory: " + ("counted by SimulatedGPU" if device.type == "cpu" and SimulatedGPU
                                  else "not measured on this device") + ")")
    record = {"benchmark": "amp", **info, "batch": batch, "repeats": repeats, "warmup": args.warmup,
              "torch_threads": torch.get_num_threads(), "results": results,
              "note": "speedup_vs_fp32 = fp32 median / mode median, both from one interleaved run"}
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"amp_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {os.path.relpath(out)}")
    return record


if __name__ == "__main__":
    main()
