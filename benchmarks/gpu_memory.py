"""GPU memory reference figures: the estimator against the real allocator, allocated vs reserved, OOM recovery.

The "memory" section of benchmarks/results/gpu_reference.json (written by the GPU check script, which calls
`run(device)`); notebook 05 shows it with `course_utils.reference.show_reference("memory")`.

    .venv/bin/python benchmarks/gpu_memory.py              # the course's device (get_device()), full sizes
    .venv/bin/python benchmarks/gpu_memory.py --quick      # tiny sizes, a few seconds (also on a CPU)

What is measured:
  estimator   for SimpleCNN and CifarCNN, SGD / SGD+momentum / Adam and a few batch sizes: the peak that
              `course_utils.memory.estimate_training_memory` predicts against the measured peak of a steady-state
              training step (the third; the optimizer state exists). CUDA: torch.cuda.max_memory_allocated minus
              what was allocated before the model existed (a warm-up matmul first, so cuBLAS's workspace is in
              that baseline: the comparison uses the estimate without its `library_workspace`); CPU:
              `SimulatedGPU`'s count of the step's tensor storages.
  allocator   (CUDA only) memory_allocated / memory_reserved before a 256 MiB tensor, with it, after `del`, after
              torch.cuda.empty_cache(): the cache keeps freed memory reserved; empty_cache returns it to the driver
              and frees nothing that is alive (claim 9).
  fragmentation (CUDA only) 2 MiB blocks, every other one freed, under a cap that leaves no room for a new
              segment: is a 4 MiB request refused although far more than that is reserved but unallocated, and
              does empty_cache() change that? (With the allocator settings of this process: `alloc_conf`.)
  recovery    a training step whose full batch does not fit a budget (`limit_gpu_memory` on CUDA, `SimulatedGPU`
              on the CPU), run by `ResilientStep`: out-of-memory errors recovered, the micro-batch size that
              worked, and how far the update is from the full batch's.
`quick=True` runs the CPU-compatible parts with tiny sizes; the CUDA-only parts say "skipped: no CUDA".
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from course_utils.data import synthetic_digits
from course_utils.device import get_device
from course_utils.memory import ResilientStep, SimulatedGPU, estimate_training_memory, free_memory, limit_gpu_memory
from course_utils.models import CifarCNN, SimpleCNN
from course_utils.timing import stamp, synchronize

MIB = 2 ** 20
NO_CUDA = "skipped: no CUDA"
MODELS = {"SimpleCNN": (SimpleCNN, (1, 28, 28)), "CifarCNN": (CifarCNN, (3, 32, 32))}
OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.01),
    "SGD+momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
}


def _settings(device: torch.device, quick: bool) -> dict:
    if quick:
        return {"estimator_batches": [2], "recovery_batch": 32}
    if device.type == "cuda":
        return {"estimator_batches": [32, 256, 1024], "recovery_batch": 2048}
    return {"estimator_batches": [32, 128], "recovery_batch": 128}


def _train_step(model, optimizer, x, y) -> None:
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def _cuda_baseline(device: torch.device) -> int:
    """Allocated bytes with nothing of ours alive, after a warm-up matmul (cuBLAS's workspace exists)."""
    a = torch.ones(64, 64, device=device)
    (a @ a).sum()
    del a
    free_memory()
    synchronize(device)
    return torch.cuda.memory_allocated(device)


# --- the estimator against the allocator ---------------------------------------------------------------

def estimator_row(model_name: str, opt_name: str, batch: int, device: torch.device) -> dict:
    """Predicted and measured peak of one steady-state training step (bytes and MiB)."""
    cls, shape = MODELS[model_name]
    if device.type == "cuda":
        start = _cuda_baseline(device)
    torch.manual_seed(0)
    model = cls().to(device)
    optimizer = OPTIMIZERS[opt_name](model.parameters())
    x = torch.rand(batch, *shape, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    t0 = time.perf_counter()
    est = estimate_training_memory(model, optimizer, (x, y), F.cross_entropy)
    est_seconds = time.perf_counter() - t0
    predicted = est.total - est.library_workspace
    if device.type == "cuda":
        for _ in range(2):
            _train_step(model, optimizer, x, y)  # the second creates no state: steady state from here on
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        _train_step(model, optimizer, x, y)
        synchronize(device)  # CPU-GPU sync point here, outside any timing
        measured = torch.cuda.max_memory_allocated(device) - start
        source = "torch.cuda.max_memory_allocated - baseline"
    else:
        with SimulatedGPU("1TiB", model=model, optimizer=optimizer) as gpu:  # counts, never runs out
            gpu.track(x, y)
            for _ in range(2):
                _train_step(model, optimizer, x, y)
            gpu.reset_peak_memory_stats()
            _train_step(model, optimizer, x, y)
            measured = gpu.max_memory_allocated()
        source = "SimulatedGPU"
    del model, optimizer, x, y
    return {"model": model_name, "optimizer": opt_name, "batch": batch,
            "estimate_mib": predicted / MIB, "measured_mib": measured / MIB,
            "error_pct": 100.0 * (predicted - measured) / measured,
            "parameters_mib": est.parameters / MIB, "gradients_mib": est.gradients / MIB,
            "optimizer_state_mib": est.optimizer_state / MIB, "activations_mib": est.activations / MIB,
            "library_workspace_mib": est.library_workspace / MIB, "estimate_seconds": est_seconds,
            "measured_with": source}


def estimator_errors(device: torch.device, batches: list[int]) -> dict:
    if device.type not in ("cuda", "cpu"):
        return {"skipped": f"no peak-memory reading on {device.type}"}
    rows = [estimator_row(m, o, b, device) for m in MODELS for b in batches for o in OPTIMIZERS]
    return {"rows": rows, "worst_abs_error_pct": max(abs(r["error_pct"]) for r in rows)}


# --- allocated vs reserved ----------------------------------------------------------------------------

def _reading(device: torch.device) -> dict:
    synchronize(device)
    return {"allocated_mib": torch.cuda.memory_allocated(device) / MIB,
            "reserved_mib": torch.cuda.memory_reserved(device) / MIB}


def allocator_readings(device: torch.device, tensor_mib: int = 256) -> dict:
    """What the caching allocator reports around one big tensor's life, and what empty_cache changes."""
    if device.type != "cuda":
        return {"skipped": NO_CUDA}
    free_memory()
    before = _reading(device)
    x = torch.empty(tensor_mib * MIB, dtype=torch.uint8, device=device)
    with_tensor = _reading(device)
    del x
    after_del = _reading(device)
    torch.cuda.empty_cache()  # cudaFree inside: a sync point
    after_empty_cache = _reading(device)
    return {
        "tensor_mib": tensor_mib, "before": before, "with_tensor": with_tensor, "after_del": after_del,
        "after_empty_cache": after_empty_cache,
        "del_kept_it_reserved": after_del["reserved_mib"] >= before["reserved_mib"] + tensor_mib,
        "empty_cache_released_mib": after_del["reserved_mib"] - after_empty_cache["reserved_mib"],
        "empty_cache_changed_allocated": after_empty_cache["allocated_mib"] != after_del["allocated_mib"],
    }


def _try_allocate(nbytes: int, device: torch.device) -> str | None:
    """None if a tensor of nbytes could be allocated (and freed again), else the error's first line."""
    try:
        t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        del t
        return None
    except torch.OutOfMemoryError as exc:
        return str(exc).splitlines()[0][:400]


def fragmentation_run(device: torch.device, block_mib: int = 2, blocks: int = 40) -> dict:
    """Blocks of 2 MiB fill 20 MiB segments; every other one is freed, leaving 2 MiB holes. Under a cap with no
    room for another segment, is a 4 MiB request refused although 40 MiB are reserved but unallocated, and does
    empty_cache() change that? (It cannot release a segment that still holds a live block.)"""
    if device.type != "cuda":
        return {"skipped": NO_CUDA}
    free_memory()
    tensors = [torch.empty(block_mib * MIB, dtype=torch.uint8, device=device) for _ in range(blocks)]
    del tensors[::2]  # holes between live blocks
    free_memory()
    reserved = torch.cuda.memory_reserved(device)
    allocated = torch.cuda.memory_allocated(device)
    # the request must not fit any free block already cached (ours are block_mib; earlier work may have left
    # bigger ones), and must stay below 10 MiB, where the allocator asks for a whole new 20 MiB segment
    index = device.index if device.index is not None else torch.cuda.current_device()
    largest_free = max((b["size"] for seg in torch.cuda.memory_snapshot(include_traces=False)
                        if seg.get("device", index) == index and seg.get("segment_type") == "large"
                        for b in seg["blocks"] if b["state"] == "inactive"), default=0)
    request = max(2 * block_mib * MIB, (largest_free // (2 * MIB) + 1) * 2 * MIB)
    stats = torch.cuda.memory_stats(device)
    if request >= 10 * MIB:
        del tensors
        free_memory()
        return {"skipped": f"a free cached block of {largest_free / MIB:.1f} MiB already exists: no request "
                           "between it and 10 MiB is left to show fragmentation with"}
    out = {"block_mib": block_mib, "blocks": blocks, "request_mib": request / MIB,
           "largest_free_block_mib": largest_free / MIB,
           "reserved_mib": reserved / MIB, "reserved_unallocated_mib": (reserved - allocated) / MIB,
           "inactive_split_mib": stats.get("inactive_split_bytes.all.current", 0) / MIB,
           "cap_mib": (reserved + 10 * MIB) / MIB,
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    try:
        with limit_gpu_memory(reserved + 10 * MIB, device):  # room for 10 MiB more: not for a 20 MiB segment
            out["first_try"] = _try_allocate(request, device) or "ok"
            before = torch.cuda.memory_reserved(device)
            torch.cuda.empty_cache()
            out["empty_cache_released_mib"] = (before - torch.cuda.memory_reserved(device)) / MIB
            out["after_empty_cache"] = _try_allocate(request, device) or "ok"
    finally:
        del tensors
        free_memory()
    out["refused_although_reserved_unallocated_was_enough"] = (
        out["first_try"] != "ok" and out["reserved_unallocated_mib"] >= out["request_mib"])
    return out


# --- recovery ----------------------------------------------------------------------------------------

def recovery_run(device: torch.device, batch: int) -> dict:
    """A step whose full batch needs more memory than the budget, run by ResilientStep."""
    if device.type not in ("cuda", "cpu"):
        return {"skipped": f"no memory limit on {device.type}"}
    data = synthetic_digits(batch, seed=0)
    x, y = data.images.to(device), data.labels.to(device)
    torch.manual_seed(0)
    model = SimpleCNN().to(device)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    if device.type == "cuda":
        start = _cuda_baseline(device)
        torch.cuda.reset_peak_memory_stats(device)
        _train_step(reference, ref_opt, x, y)  # the full batch, no limit: the update to match and its peak
        synchronize(device)
        step_extra = torch.cuda.max_memory_allocated(device) - start
    else:
        with SimulatedGPU("1TiB", model=reference, optimizer=ref_opt) as gpu:
            gpu.track(x, y)
            start = gpu.memory_allocated()
            _train_step(reference, ref_opt, x, y)
            step_extra = gpu.max_memory_allocated() - start
    expected = [p.detach().to("cpu", copy=True) for p in reference.parameters()]  # a sync point on CUDA
    del reference, ref_opt
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = ResilientStep(model, optimizer, F.cross_entropy)
    if device.type == "cuda":
        free_memory()
        resident = torch.cuda.memory_reserved(device)  # the cap counts reserved memory
        budget = int(resident + 0.5 * step_extra)
        with limit_gpu_memory(budget, device):
            loss = step(x, y)
            synchronize(device)
        limited_with = "limit_gpu_memory"
    else:
        with SimulatedGPU("1TiB", model=model, optimizer=optimizer) as probe:
            probe.track(x, y)
            resident = probe.memory_allocated()
        budget = int(resident + 0.5 * step_extra)
        with SimulatedGPU(budget, model=model, optimizer=optimizer) as gpu:
            gpu.track(x, y)
            loss = step(x, y)
        limited_with = "SimulatedGPU"
    diff = max(float((p.detach().cpu() - q).abs().max()) for p, q in zip(model.parameters(), expected))
    return {"batch": batch, "budget_mib": budget / MIB, "resident_mib": resident / MIB,
            "full_step_extra_mib": step_extra / MIB, "limited_with": limited_with,
            "oom_count": step.oom_count, "micro_batch_size": step.micro_batch_size,
            "loss": float(loss), "max_abs_param_diff_vs_full_batch": diff,
            "matches_full_batch": diff <= 1e-4}


# --- all of it ---------------------------------------------------------------------------------------

def _guarded(fn, *args) -> dict:
    """Run one part; a failure becomes {"error": ...} so the other parts keep their figures."""
    try:
        return fn(*args)
    except Exception as exc:  # one broken part must not cost the others
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]}


def run(device: torch.device, quick: bool = False) -> dict:
    """Measure the memory figures notebook 05 shows, on `device`; a JSON-able dict.

        {"benchmark": "memory", "device": "cuda", "hardware": "...", "torch": "...", "quick": false,
         "settings": {...}, "alloc_conf": null,
         "estimator": {"rows": [{"model", "optimizer", "batch", "estimate_mib", "measured_mib", "error_pct", ...}],
                       "worst_abs_error_pct": 3.1},
         "allocator": {"before": {"allocated_mib", "reserved_mib"}, "with_tensor": ..., "after_del": ...,
                       "after_empty_cache": ..., "empty_cache_released_mib": 256.0, ...},
         "fragmentation": {"request_mib": 4.0, "reserved_unallocated_mib": 40.0, "first_try": "ok" or the
                           OOM message, "empty_cache_released_mib": 0.0, "after_empty_cache": ..., ...},
         "recovery": {"oom_count": 1, "micro_batch_size": 1024, "matches_full_batch": true, ...},
         "notes": [...]}

    CUDA-only parts read {"skipped": "skipped: no CUDA"} elsewhere; a part that fails reads {"error": ...}.
    """
    device = torch.device(device)
    settings = _settings(device, quick)
    info = stamp(device)
    result = {"benchmark": "memory", "device": str(device), "hardware": info["hardware"], "torch": info["torch"],
              "quick": quick, "settings": settings,
              "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    # the allocator parts first, while little else has been cached
    result["allocator"] = _guarded(allocator_readings, device)
    result["fragmentation"] = _guarded(fragmentation_run, device)
    result["estimator"] = _guarded(estimator_errors, device, settings["estimator_batches"])
    result["recovery"] = _guarded(recovery_run, device, settings["recovery_batch"])
    result["notes"] = [
        "estimator: error_pct = (estimate - measured) / measured; the estimate leaves out cuDNN workspaces and "
        "allocator rounding beyond 512 bytes",
        "allocator: empty_cache() returns cached, unused segments to the driver: reserved falls, allocated does not",
        "fragmentation: a cap (torch.cuda.set_per_process_memory_fraction) leaves no room for a new segment; "
        "'ok' means the 4 MiB request succeeded",
        "recovery: the budget is the memory in use before the step plus half of what the full batch's step adds",
    ]
    return result


def _print_summary(result: dict) -> None:
    print(f"memory figures on {result['hardware']} (torch {result['torch']}, quick={result['quick']}):")
    est = result["estimator"]
    for r in est.get("rows", []):
        print(f"  {r['model']:<10}{r['optimizer']:<13}batch {r['batch']:>5}: estimate {r['estimate_mib']:8.2f} MiB, "
              f"measured {r['measured_mib']:8.2f} MiB ({r['error_pct']:+.1f}%)")
    for name in ("allocator", "fragmentation", "recovery"):
        print(f"  {name}: {json.dumps(result[name])}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cpu, cuda (default: get_device())")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    ap.add_argument("--out", default=None, help="also write the result (with a stamp) to this JSON file")
    args = ap.parse_args(argv)
    device = get_device(args.device)
    result = run(device, quick=args.quick)
    _print_summary(result)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"stamp": stamp(device), "sections": {"memory": result}}, indent=2) + "\n")
        print(f"wrote {out.name}")
    return result


if __name__ == "__main__":
    main()
