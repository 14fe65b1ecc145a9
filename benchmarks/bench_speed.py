"""The speed ladder on this machine, every rung including torch.compile, measured in one run.

    .venv/bin/python benchmarks/bench_speed.py                 # on the device get_device() picks
    .venv/bin/python benchmarks/bench_speed.py --device cpu --rounds 3

Prints images/s and the ratio to the naive loop for each rung (with --rounds > 1 the rungs are measured in
alternation and each keeps its median, so load on the machine affects them alike), and writes
benchmarks/results/speed_<device type>.json stamped with hardware, torch version, date and commit.
Notebook 04 runs the same ladder without torch.compile; this script is where the compiled rung is measured.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from course_utils import get_device, speed
from course_utils.data import synthetic_cifar
from course_utils.timing import stamp

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", help="cpu, cuda, mps (default: what get_device() picks)")
    parser.add_argument("--rounds", type=int, default=3, help="measure the rungs in alternation this many times")
    parser.add_argument("--images", type=int, help="images per timed chunk (default: 256 on a CPU, 4096 on a GPU)")
    parser.add_argument("--repeats", type=int, default=3, help="timed chunks per rung and round")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first (they include compiling)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rung")
    args = parser.parse_args(argv)

    device = get_device(args.device)
    images = args.images or (256 if device.type == "cpu" else 4096)
    data = synthetic_cifar(4096, seed=0)
    t0 = time.perf_counter()
    result = speed.run_ladder(device, data, include_compile=not args.no_compile, rounds=args.rounds, images=images,
                              repeats=args.repeats, warmup_steps=args.warmup_steps)
    seconds = time.perf_counter() - t0

    ratios = result.ratios()
    print(f"speed ladder on {device} ({args.rounds} rounds, {images} images per chunk, {seconds:.0f} s):")
    for name, ips in result.images_per_s.items():
        print(f"  {name:16s} {ips:10,.0f} images/s  {ratios[name]:6.2f}x the naive loop")
    for name, why in {**result.skipped, **result.errors}.items():
        print(f"  {name:16s} not measured: {why}")

    out = ROOT / "benchmarks" / "results" / f"speed_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"stamp": stamp(device), "rounds": args.rounds, "images_per_chunk": images,
                               "repeats": args.repeats, "warmup_steps": args.warmup_steps,
                               "seconds": round(seconds, 1), "ladder": result.to_dict()}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
