"""What a periodic checkpoint costs: the Trainer's step time with `Checkpoint(path, every_n_steps=N)` against none.

SimpleCNN (the notebooks' model) on synthetic digits, batch 64, on this machine's default device; one epoch per
contender per round, contenders in rotated order, the paired ratio to the run without checkpoints (median over
rounds). A save writes the model, the optimizer state and the loader position atomically (fsync, rename) and reads
the running loss once (a sync). Prints the figures and writes benchmarks/results/checkpoint_<device>.json.

    .venv/bin/python benchmarks/bench_checkpoint.py [--quick]
"""
import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from course_utils import get_device
from course_utils.callbacks import Checkpoint
from course_utils.data import TensorLoader, synthetic_digits
from course_utils.models import SimpleCNN
from course_utils.timing import stamp, synchronize
from course_utils.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def main(quick: bool):
    device = get_device()
    steps = 100 if quick else 400
    rounds = 3 if quick else 5
    data = synthetic_digits(steps * 64, seed=0)
    folder = Path(tempfile.mkdtemp())
    intervals = [None, 100, 10]

    def make(every):
        torch.manual_seed(0)
        model = SimpleCNN()
        callbacks = [] if every is None else [Checkpoint(folder / f"every{every}.pt", every_n_steps=every)]
        return Trainer(model, torch.optim.AdamW(model.parameters(), 1e-3), nn.CrossEntropyLoss(),
                       TensorLoader.from_dataset(data, batch_size=64, device=device), device=device,
                       callbacks=callbacks)

    trainers = {every: make(every) for every in intervals}
    times = {every: [] for every in intervals}
    for r in range(rounds + 1):  # round 0 warms up
        order = intervals[r % 3:] + intervals[:r % 3]
        for every in order:
            synchronize(device)
            t0 = time.perf_counter()
            trainers[every](1)
            synchronize(device)
            if r:
                times[every].append(time.perf_counter() - t0)
    size = (folder / "every10.pt").stat().st_size
    base = times[None]
    result = {"stamp": stamp(device), "model": "SimpleCNN", "batch": 64, "steps_per_epoch": steps, "rounds": rounds,
              "checkpoint_bytes": size, "step_s": {}, "paired_ratio": {}}
    print(f"{result['stamp']['hardware']}: SimpleCNN, batch 64, {steps} steps an epoch, {rounds} rounds; "
          f"a checkpoint is {size / 2**20:.1f} MiB")
    for every in intervals:
        step = statistics.median(times[every]) / steps
        ratio = statistics.median(t / b for t, b in zip(times[every], base))
        label = "no checkpoint" if every is None else f"every {every} steps"
        result["step_s"][label] = step
        result["paired_ratio"][label] = ratio
        print(f"  {label:<16} {step * 1e3:8.2f} ms a step   x{ratio:.3f} the run without")
    out = ROOT / "benchmarks" / "results" / f"checkpoint_{device.type}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    main(p.parse_args().quick)
