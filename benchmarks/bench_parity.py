"""Parity: course_utils.Trainer against a hand-written loop on the same model, data and seed.

Checks, in one process with interleaved runs (Trainer epoch, hand epoch, hand epoch, Trainer epoch, ...):
  - identical per-epoch losses (to 5 decimals; in fact bit-identical on the CPU),
  - median time per step within 1 %,
  - no higher peak memory (CUDA: max_memory_allocated; CPU: SimulatedGPU's accounting of tensor storage).
Prints the ratios and writes benchmarks/results/parity_<device>.json.

    .venv/bin/python benchmarks/bench_parity.py [--rounds 10]
"""
import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from course_utils import Trainer, get_device
from course_utils.data import TensorLoader, synthetic_digits
from course_utils.memory import SimulatedGPU, format_bytes
from course_utils.models import SimpleCNN
from course_utils.timing import stamp, synchronize

ROOT = Path(__file__).resolve().parents[1]


def hand_epoch(model, optimizer, loss_fn, loader, device):
    """The loop a careful learner writes: losses summed on the device, one sync per epoch."""
    model.train()
    total, count = torch.zeros((), device=device), 0
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        total += loss.detach() * len(y)
        count += len(y)
    return (total / count).item()


def peak_memory(run, device, model, optimizer):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        run()
        return torch.cuda.max_memory_allocated()
    with SimulatedGPU("64GiB", model=model, optimizer=optimizer) as gpu:
        run()
        return gpu.max_memory_allocated()


def main(rounds: int, n: int, batch: int):
    device = get_device()
    data = synthetic_digits(n, seed=0)
    torch.manual_seed(0)
    model_t = SimpleCNN().to(device)
    model_h = copy.deepcopy(model_t)
    opt_t = torch.optim.SGD(model_t.parameters(), lr=0.05, momentum=0.9)
    opt_h = torch.optim.SGD(model_h.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    loader_t = TensorLoader.from_dataset(data, batch_size=batch, device=device, seed=1)
    loader_h = TensorLoader.from_dataset(data, batch_size=batch, device=device, seed=1)
    trainer = Trainer(model_t, opt_t, loss_fn, loader_t, device=device)
    steps = len(loader_t)

    def run_trainer():
        return trainer(1)[0]

    def run_hand():
        return hand_epoch(model_h, opt_h, loss_fn, loader_h, device)

    losses = {"trainer": [], "hand": []}
    times = {"trainer": [], "hand": []}
    runs = {"trainer": run_trainer, "hand": run_hand}
    for name in ("trainer", "hand"):  # warm-up epoch each (allocator caches, lazy init), not timed
        losses[name].append(runs[name]())
    for r in range(rounds):
        order = ["trainer", "hand"] if r % 2 == 0 else ["hand", "trainer"]  # ABBA: cancels drift
        for name in order:
            synchronize(device)
            t0 = time.perf_counter()
            losses[name].append(runs[name]())
            synchronize(device)
            times[name].append((time.perf_counter() - t0) / steps)
    same = [round(a, 5) == round(b, 5) for a, b in zip(losses["trainer"], losses["hand"])]
    bit_identical = losses["trainer"] == losses["hand"]
    t_med, h_med = statistics.median(times["trainer"]), statistics.median(times["hand"])
    paired = statistics.median(t / h for t, h in zip(times["trainer"], times["hand"]))  # same round, same load
    # one more epoch each, measured for peak memory (state is identical, so the peaks are comparable)
    peak_t = peak_memory(run_trainer, device, model_t, opt_t)
    peak_h = peak_memory(run_hand, device, model_h, opt_h)
    result = {
        "stamp": stamp(device), "rounds": rounds, "steps_per_epoch": steps, "batch_size": batch,
        "losses_equal_to_5_decimals": all(same), "losses_bit_identical": bit_identical,
        "median_step_s": {"trainer": t_med, "hand": h_med}, "step_time_ratio": t_med / h_med,
        "paired_step_time_ratio": paired, "step_s": times,
        "peak_bytes": {"trainer": peak_t, "hand": peak_h}, "peak_ratio": peak_t / peak_h,
    }
    print(f"device: {result['stamp']['hardware']}")
    print(f"losses equal to 5 decimals in all {rounds + 1} epochs: {all(same)} (bit-identical: {bit_identical})")
    print(f"median step: Trainer {t_med * 1e3:.3f} ms, hand-written {h_med * 1e3:.3f} ms, "
          f"ratio {t_med / h_med:.4f}, paired by round {paired:.4f} (target <= 1.01)")
    print(f"peak memory: Trainer {format_bytes(peak_t)}, hand-written {format_bytes(peak_h)}, "
          f"ratio {peak_t / peak_h:.3f} (target <= 1)")
    out = ROOT / "benchmarks" / "results" / f"parity_{device.type}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--batch", type=int, default=128)
    a = p.parse_args()
    main(a.rounds, a.n, a.batch)
