"""course_utils.memory: SimulatedGPU's overhead and estimate_training_memory's error.

    python benchmarks/bench_memory.py                      # CPU: SimulatedGPU is the measuring stick
    python benchmarks/bench_memory.py --device cuda        # CUDA: torch.cuda.max_memory_allocated is

1. Slowdown of one training step (SimpleCNN, batch 64, SGD with momentum) when run inside a
   SimulatedGPU, the two timed interleaved (plain, simulated, plain, ...) in one process so load drift
   hits both alike. Reported: median of each, the ratio of medians and the median of per-round ratios
   ("paired"), and the overhead per dispatched operator. Target: at most 4x. CPU only.
2. The estimator's error on each course model (SimpleCNN on 1x28x28, CifarCNN on 3x32x32), batch sizes
   32..512, optimizers SGD / SGD+momentum / Adam: predicted peak vs the measured peak of the second of
   two training steps (the steady state: optimizer state exists). Target: within 10%.

Writes benchmarks/results/memory_<device>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from course_utils.memory import SimulatedGPU, estimate_training_memory, format_bytes  # noqa: E402
from course_utils.models import CifarCNN, SimpleCNN  # noqa: E402
from course_utils.timing import format_seconds, measure_interleaved, stamp  # noqa: E402

MODELS = {"SimpleCNN": (SimpleCNN, (1, 28, 28)), "CifarCNN": (CifarCNN, (3, 32, 32))}
OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.01),
    "SGD+momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
}


def train_step(model, opt, x, y) -> None:
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()


def count_ops(fn) -> int:
    """Operators dispatched by one call of fn (what SimulatedGPU pays for)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.n += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return Counter.n


def bench_overhead(batch: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = SimpleCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.rand(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    gpu = SimulatedGPU("64GiB", model=model, optimizer=opt)

    def plain():
        train_step(model, opt, x, y)

    def simulated():
        with gpu:
            train_step(model, opt, x, y)

    results = measure_interleaved({"plain": plain, "simulated": simulated}, warmup=3, repeats=repeats)
    p, s = results["plain"], results["simulated"]
    paired = statistics.median(b / a for a, b in zip(p.times, s.times))
    ops = count_ops(plain)
    per_op = per_op_overhead(repeats)
    out = {
        "model": "SimpleCNN", "batch": batch, "optimizer": "SGD+momentum", "repeats": repeats,
        "plain_median_s": p.median, "simulated_median_s": s.median,
        "ratio_of_medians": s.median / p.median, "paired_ratio_median": paired, "target_max_ratio": 4.0,
        "ops_per_step": ops, "overhead_per_op_s": per_op,
        "overhead_per_step_s": ops * per_op, "overhead_fraction_of_plain_step": ops * per_op / p.median,
    }
    print(f"SimulatedGPU slowdown, SimpleCNN batch {batch} (SGD+momentum), {repeats} interleaved rounds:")
    print(f"  plain {format_seconds(p.median)}, simulated {format_seconds(s.median)}: "
          f"{out['ratio_of_medians']:.2f}x (paired median {paired:.2f}x; target <= 4x)")
    print(f"  {ops} operators per step x {format_seconds(per_op)} per operator (measured on 1-element tensors) = "
          f"{format_seconds(ops * per_op)} per step, {out['overhead_fraction_of_plain_step']:.1%} of a plain step")
    return out


def per_op_overhead(repeats: int, n: int = 2000) -> float:
    """Seconds SimulatedGPU adds to one operator, isolated: n additions on a 1-element tensor, with and
    without it, interleaved; difference of medians / n."""
    gpu = SimulatedGPU("1GiB")

    def chain():
        x = torch.zeros(1)
        for _ in range(n):
            x = x + 1

    def simulated():
        with gpu:
            chain()

    r = measure_interleaved({"plain": chain, "simulated": simulated}, warmup=2, repeats=repeats)
    return max(r["simulated"].median - r["plain"].median, 0.0) / n


def measured_peak(model, opt, x, y, device: torch.device) -> int:
    """Peak of the second of two steps (steady state), batch already on the device."""
    if device.type == "cuda":
        x, y = x.to(device), y.to(device)
        train_step(model, opt, x, y)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        train_step(model, opt, x, y)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    with SimulatedGPU("64GiB", model=model, optimizer=opt) as gpu:
        x, y = x.clone(), y.clone()  # made inside: counted like a batch moved to the GPU
        train_step(model, opt, x, y)
        gpu.reset_peak_memory_stats()
        train_step(model, opt, x, y)
        return gpu.max_memory_allocated()


def bench_estimator(device: torch.device, batches: list[int]) -> list[dict]:
    rows = []
    oracle = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "SimulatedGPU"
    print(f"\nestimate_training_memory vs measured peak ({oracle}):")
    print(f"  {'model':<10}{'batch':>6}  {'optimizer':<13}{'estimate':>12}{'measured':>12}{'error':>8}{'time':>10}")
    for name, (cls, shape) in MODELS.items():
        for batch in batches:
            for opt_name, make_opt in OPTIMIZERS.items():
                torch.manual_seed(0)
                model = cls().to(device)
                opt = make_opt(model.parameters())
                x, y = torch.rand(batch, *shape, device=device), torch.randint(0, 10, (batch,), device=device)
                t0 = time.perf_counter()
                est = estimate_training_memory(model, opt, (x, y), F.cross_entropy)
                est_time = time.perf_counter() - t0
                peak = measured_peak(model, opt, x, y, device)
                err = (est.total - peak) / peak
                rows.append({"model": name, "batch": batch, "optimizer": opt_name, "estimate_bytes": est.total,
                             "measured_bytes": peak, "relative_error": err, "estimate_seconds": est_time,
                             "activations_bytes": est.activations, "optimizer_state_bytes": est.optimizer_state})
                print(f"  {name:<10}{batch:>6}  {opt_name:<13}{format_bytes(est.total):>12}"
                      f"{format_bytes(peak):>12}{err:>+8.1%}{format_seconds(est_time):>10}")
                del model, opt, x, y
    worst = max(abs(r["relative_error"]) for r in rows)
    print(f"  worst |error|: {worst:.2%} (target <= 10%)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128, 512])
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda needs a CUDA GPU; torch.cuda.is_available() is False here")

    result = {"stamp": stamp(device), "device": str(device)}
    if device.type == "cpu":
        result["simulated_gpu_overhead"] = bench_overhead(args.batch, args.repeats)
    rows = bench_estimator(device, args.batches)
    result["estimator"] = {"rows": rows, "worst_abs_relative_error": max(abs(r["relative_error"]) for r in rows),
                           "target_max_abs_relative_error": 0.10}
    out = Path(__file__).resolve().parent / "results" / f"memory_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out}")


if __name__ == "__main__":
    main()
