"""Mixed precision on one device: training-step time and peak memory, fp32 vs bf16 vs fp16.

The "amp" section of benchmarks/results/gpu_reference.json (written by the GPU check script, which calls
`run(device)`); notebook 06 shows it beside the figures it measures live on the learner's machine.

    .venv/bin/python benchmarks/gpu_amp.py              # the course's device (get_device()), full sizes
    .venv/bin/python benchmarks/gpu_amp.py --quick      # tiny sizes, a few seconds (also on a CPU)

What is measured, per model (SimpleCNN, CifarCNN) and mode:
  - step time: one `course_utils.amp.train_step` (zero_grad, autocast forward + loss, backward, optimizer step)
    on a fixed batch already on the device. The modes are timed interleaved (fp32, bf16, fp16, fp32, ...), each
    sample a run of several steps closed by a device synchronize; medians and IQRs per step, and the
    speedup over fp32 both as a ratio of medians and as the median of per-round ratios ("paired").
  - peak memory: each mode alone, in a fresh model: after two warm-up steps (optimizer state exists), the peak
    of one step. CUDA: torch.cuda.max_memory_allocated; CPU: course_utils.memory.SimulatedGPU's count of live
    tensor storages; MPS: not measured (None). `peak_mib` counts everything the step needs (parameters,
    gradients, optimizer state, the batch, activations, autocast's 16-bit weight copies); `resident_mib` is what
    was allocated before the step, `step_peak_mib` the growth during it.
Modes: fp32 always; bf16 where the device does it natively (CUDA compute capability 8.0+, CPU); fp16 on CUDA,
MPS and (slow, tiny sizes only) CPU. A mode that cannot run says why instead of a figure.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from course_utils.amp import MixedPrecision, train_step
from course_utils.device import get_device
from course_utils.models import CifarCNN, SimpleCNN
from course_utils.timing import measure_interleaved, stamp, synchronize

MIB = 2 ** 20
MODELS = {"SimpleCNN": (SimpleCNN, (1, 28, 28)), "CifarCNN": (CifarCNN, (3, 32, 32))}
MODES = ("fp32", "bf16", "fp16")


def _settings(device: torch.device, quick: bool) -> dict:
    """Batch size, timing rounds and steps per timed sample for this device and size."""
    if quick:
        return {"batch": 2, "warmup": 1, "repeats": 2, "steps_per_sample": 1, "memory_warmup": 1}
    if device.type == "cpu":
        return {"batch": 64, "warmup": 2, "repeats": 7, "steps_per_sample": 1, "memory_warmup": 2}
    # a GPU step of these small models takes about a millisecond: time runs of 10 steps so that the
    # synchronize and the Python loop around each sample do not dominate what is measured
    return {"batch": 256, "warmup": 3, "repeats": 25, "steps_per_sample": 10, "memory_warmup": 2}


def supported_modes(device: torch.device, quick: bool = False) -> dict[str, str | None]:
    """Each mode -> None if it runs on `device`, else the reason it is skipped."""
    reasons: dict[str, str | None] = {"fp32": None, "bf16": None, "fp16": None}
    if device.type == "cuda":
        if not torch.cuda.is_bf16_supported(including_emulation=False):
            reasons["bf16"] = ("no native bfloat16 on this GPU (compute capability below 8.0): emulated bf16 "
                               "would be slower than fp16, so it is not measured")
    elif device.type == "cpu":
        if not quick:
            reasons["fp16"] = ("float16 has no fast kernels on most CPUs (4-16x slower than fp32): measured only "
                               "with --quick sizes")
    elif device.type == "mps":
        reasons["bf16"] = "bfloat16 autocast on MPS needs a recent macOS; the course uses float16 there"
    else:
        raise ValueError(f"no AMP benchmark for device type {device.type!r}")
    return reasons


def _make_step(model_cls, shape: tuple[int, ...], batch: int, device: torch.device, mode: str,
               steps: int) -> tuple[Callable[[], None], dict]:
    """A closure running `steps` training steps of a fresh, seeded model in `mode`, and its parts."""
    torch.manual_seed(0)
    model = model_cls().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    precision = MixedPrecision(device, mode)
    x = torch.rand(batch, *shape, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def run() -> None:
        for _ in range(steps):
            train_step(model, optimizer, F.cross_entropy, x, y, precision)  # no sync inside (bf16/fp32)

    parts = {"model": model, "optimizer": optimizer, "precision": precision, "batch": (x, y)}
    return run, parts


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_memory(model_cls, shape: tuple[int, ...], batch: int, device: torch.device, mode: str,
                warmup: int = 2) -> dict:
    """Peak memory of one steady-state training step in `mode`, measured alone in a fresh model (MiB).

    `warmup` steps first (at least 1): the optimizer state must exist before the measured step."""
    warmup = max(1, warmup)
    _free(device)
    if device.type == "cuda":
        synchronize(device)
        start = torch.cuda.memory_allocated(device)  # whatever else this process holds
        step, parts = _make_step(model_cls, shape, batch, device, mode, steps=1)
        for _ in range(warmup):
            step()  # afterwards optimizer state and cuDNN choices exist: the next step is the steady state
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        synchronize(device)  # CPU-GPU sync point here, outside any timed region
        peak = torch.cuda.max_memory_allocated(device)
        del step, parts
        _free(device)
        return {"peak_mib": (peak - start) / MIB, "resident_mib": (before - start) / MIB,
                "step_peak_mib": (peak - before) / MIB, "memory_source": "torch.cuda.max_memory_allocated"}
    if device.type == "cpu":
        from course_utils.memory import SimulatedGPU

        step, parts = _make_step(model_cls, shape, batch, device, mode, steps=1)
        for _ in range(warmup):
            step()
        with SimulatedGPU("1TiB", model=parts["model"], optimizer=parts["optimizer"]) as gpu:  # counts, never OOMs
            gpu.track(*parts["batch"])
            before = gpu.memory_allocated()
            gpu.reset_peak_memory_stats()
            step()
            peak = gpu.max_memory_allocated()
        return {"peak_mib": peak / MIB, "resident_mib": before / MIB, "step_peak_mib": (peak - before) / MIB,
                "memory_source": "course_utils.memory.SimulatedGPU (CPU tensor storages, counted like CUDA)"}
    return {"peak_mib": None, "resident_mib": None, "step_peak_mib": None,
            "memory_source": f"not measured on {device.type}"}


def _precision_flags() -> dict:
    """The float32 precision settings in force (TF32 changes what 'fp32' means on Ampere and later GPUs)."""
    flags = {}
    try:
        flags["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    except RuntimeError as exc:  # torch >= 2.9 refuses to answer once the new fp32_precision API was used
        flags["float32_matmul_precision"] = f"unreadable ({str(exc).split(',')[0]})"
    for name, get in (("cuda_matmul_fp32_precision", lambda: torch.backends.cuda.matmul.fp32_precision),
                      ("cudnn_conv_fp32_precision", lambda: torch.backends.cudnn.conv.fp32_precision)):
        try:
            flags[name] = get()
        except (AttributeError, RuntimeError):  # older torch: only the allow_tf32 flags exist
            flags[name] = None
    return flags


def run(device: torch.device, quick: bool = False) -> dict:
    """Measure AMP's step time and peak memory for the course models on `device`; a JSON-able dict.

        {"device": "cuda", "hardware": "...", "settings": {"batch": 256, ...},
         "modes": {"fp32": null, "bf16": null, "fp16": "reason it was skipped" or null},
         "models": {"SimpleCNN": {"fp32": {"dtype": "float32", "grad_scaler": false, "step_ms": 1.2,
                                           "step_ms_iqr": 0.1, "speedup_vs_fp32": 1.0,
                                           "paired_speedup_vs_fp32": 1.0, "peak_mib": 80.1,
                                           "resident_mib": 5.2, "step_peak_mib": 74.9,
                                           "memory_vs_fp32": 1.0, ...},
                                  "bf16": {...}, "fp16": {...}},
                    "CifarCNN": {...}},
         "precision_flags": {...}, "notes": [...]}

    `quick=True` runs the same code with tiny sizes (a few seconds, also on a CPU).
    """
    device = torch.device(device)
    settings = _settings(device, quick)
    reasons = supported_modes(device, quick)
    modes = [m for m in MODES if reasons[m] is None]
    k = settings["steps_per_sample"]
    models: dict[str, dict] = {}
    for name, (model_cls, shape) in MODELS.items():
        steps, rows = {}, {}
        for mode in modes:
            steps[mode], parts = _make_step(model_cls, shape, settings["batch"], device, mode, steps=k)
            rows[mode] = {"dtype": str(parts["precision"].dtype).removeprefix("torch."),
                          "grad_scaler": parts["precision"].scaler is not None}
        timed = measure_interleaved(steps, device=device, warmup=settings["warmup"], repeats=settings["repeats"])
        del steps, parts  # free the timing models before measuring memory
        ref = timed["fp32"]
        for mode in modes:
            m = timed[mode]
            paired = statistics.median(a / b for a, b in zip(ref.times, m.times))
            rows[mode].update(step_ms=m.median / k * 1e3, step_ms_iqr=m.iqr / k * 1e3,
                              speedup_vs_fp32=ref.median / m.median, paired_speedup_vs_fp32=paired)
        for mode in modes:  # memory after timing, each mode alone, so the others' tensors do not count
            rows[mode].update(peak_memory(model_cls, shape, settings["batch"], device, mode,
                                          warmup=settings["memory_warmup"]))
        fp32_peak = rows["fp32"]["peak_mib"]
        for mode in modes:
            peak = rows[mode]["peak_mib"]
            rows[mode]["memory_vs_fp32"] = peak / fp32_peak if peak is not None and fp32_peak else None
        for mode in MODES:
            if reasons[mode] is not None:
                rows[mode] = {"skipped": reasons[mode]}
        models[name] = rows
    info = stamp(device)
    return {
        "benchmark": "amp",
        "device": str(device),
        "hardware": info["hardware"],
        "torch": info["torch"],
        "quick": quick,
        "settings": {**settings, "optimizer": "SGD(lr=0.01, momentum=0.9)", "loss": "cross_entropy"},
        "modes": reasons,
        "models": models,
        "precision_flags": _precision_flags(),
        "notes": [
            "step_ms: median time of one training step; speedup_vs_fp32 = fp32 median / mode median from one "
            "interleaved run; paired_speedup_vs_fp32 = median over rounds of the same ratio",
            "peak_mib: peak memory of one steady-state step, everything included; memory_vs_fp32 = peak_mib / "
            "fp32 peak_mib",
            "fp32 may already use TF32 for convolutions on Ampere and later GPUs (see precision_flags)",
        ],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cpu, cuda, mps (default: get_device())")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    ap.add_argument("--out", default=None, help="also write the result (with a stamp) to this JSON file")
    args = ap.parse_args(argv)
    device = get_device(args.device)
    result = run(device, quick=args.quick)
    for name, rows in result["models"].items():
        print(f"{name} (batch {result['settings']['batch']}) on {result['hardware']}:")
        for mode, r in rows.items():
            if "skipped" in r:
                print(f"  {mode:>4}: skipped: {r['skipped']}")
                continue
            mem = f", peak {r['peak_mib']:.1f} MiB ({r['memory_vs_fp32']:.2f}x fp32)" if r["peak_mib"] else ""
            print(f"  {mode:>4}: {r['step_ms']:.2f} ms/step, {r['speedup_vs_fp32']:.2f}x fp32 speed "
                  f"(paired {r['paired_speedup_vs_fp32']:.2f}x){mem}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"stamp": stamp(device), "sections": {"amp": result}}, indent=2) + "\n")
        print(f"wrote {out.name}")
    return result


if __name__ == "__main__":
    main()
