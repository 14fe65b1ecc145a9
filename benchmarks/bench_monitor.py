"""Training throughput with the DeviceMonitor running versus without (target: at most 2 % slower).

    python benchmarks/bench_monitor.py                     # the course's device (get_device())
    python benchmarks/bench_monitor.py --device cpu --rounds 9 --trial-seconds 6

SimpleCNN on synthetic digits served by TensorLoader, trained by the course's Trainer; one trial is
one epoch sized to take about --trial-seconds without a monitor. Conditions, interleaved in every
round and rotated between rounds so drift in load or clock speed hits them alike:

- off:               nothing running;
- monitor:           a DeviceMonitor (default 1 s refresh, chart every 2 s) running during the epoch;
- monitor+progress:  the same plus a TrainingProgress callback (per-step update, its own thread, and
                     one final redraw at the end of each trainer call, which is included).

Reported: samples/s per condition (median over rounds) and the slowdown against "off", both as a
ratio of medians and as the median of per-round ratios ("paired", more robust to drift). Also the
monitor's own cost per refresh, measured separately. Results: benchmarks/results/monitor_<device>.json.
Outside a notebook the widgets talk to no browser, so the figure covers sampling, widget updates
and chart rendering, but not the kernel's zmq send of the (few) messages.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from course_utils.data import TensorLoader, synthetic_digits  # noqa: E402
from course_utils.device import get_device  # noqa: E402
from course_utils.models import SimpleCNN  # noqa: E402
from course_utils.monitor import DeviceMonitor, TrainingProgress  # noqa: E402
from course_utils.timing import format_seconds, synchronize  # noqa: E402

try:
    from course_utils.timing import stamp
except ImportError:  # pragma: no cover - timing.stamp is the shared stamp; keep a fallback
    stamp = None

CONDITIONS = ("off", "monitor", "monitor+progress")


def _stamp(device: torch.device) -> dict:
    if stamp is not None:
        return stamp(device)
    import datetime
    import platform
    import subprocess
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"hardware": f"{platform.processor() or platform.machine()} ({os.cpu_count()} CPUs)",
            "device": str(device), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(), "commit": commit}


def make_trainer(device: torch.device, batch: int, n: int, callbacks=()):
    from course_utils.trainer import Trainer

    data = synthetic_digits(n, seed=0)
    loader = TensorLoader(data.images, data.labels, batch_size=batch, device=device, drop_last=True, seed=0)
    torch.manual_seed(0)
    model = SimpleCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return Trainer(model, opt, F.cross_entropy, loader, device=device, callbacks=list(callbacks))


def timed_epoch(trainer) -> float:
    synchronize(trainer.device)
    t0 = time.perf_counter()
    trainer(1)  # ends with the epoch's one .item(): the device has finished when it returns
    synchronize(trainer.device)
    return time.perf_counter() - t0


def run(device: torch.device, batch: int, rounds: int, trial_seconds: float, interval: float) -> dict:
    # size one epoch to ~trial_seconds: time a short calibration epoch first (also the warm-up)
    probe = make_trainer(device, batch, batch * 10)
    timed_epoch(probe)
    per_step = timed_epoch(probe) / 10
    steps = max(20, int(trial_seconds / per_step))
    n = steps * batch
    print(f"{steps} steps of batch {batch} per trial (~{format_seconds(steps * per_step)}), {rounds} rounds")

    progress = TrainingProgress(interval=interval, display=False)
    trainers = {"off": make_trainer(device, batch, n), "monitor": make_trainer(device, batch, n),
                "monitor+progress": make_trainer(device, batch, n, callbacks=[progress])}
    for trainer in trainers.values():
        timed_epoch(trainer)  # warm-up for each: allocator, caches, first-epoch effects
    monitor = DeviceMonitor(interval=interval)
    times = {c: [] for c in CONDITIONS}
    for r in range(rounds):
        order = CONDITIONS[r % 3:] + CONDITIONS[:r % 3]
        for cond in order:
            if cond != "off":
                monitor.start()
            try:
                times[cond].append(timed_epoch(trainers[cond]))
            finally:
                monitor.stop()
        print(f"  round {r + 1}: " + ", ".join(f"{c} {times[c][-1]:.2f} s" for c in CONDITIONS))

    results = {}
    for cond in CONDITIONS:
        med = statistics.median(times[cond])
        paired = statistics.median(t / t0 for t, t0 in zip(times[cond], times["off"]))
        results[cond] = {"times_s": times[cond], "median_s": med, "samples_per_s": n / med,
                         "slowdown_vs_off": med / statistics.median(times["off"]) - 1,
                         "paired_slowdown_vs_off": paired - 1}
    # the monitor's own work per refresh (sampling + widget updates), and one chart redraw
    probe_monitor = DeviceMonitor(chart_interval=1e9)
    probe_monitor.refresh()
    probe_monitor.refresh()  # the first chart is drawn here
    refresh_s = []
    for _ in range(20):
        t0 = time.perf_counter()
        probe_monitor.refresh()
        refresh_s.append(time.perf_counter() - t0)
    chart_s = []
    for _ in range(5):
        t0 = time.perf_counter()
        probe_monitor._draw_chart()
        chart_s.append(time.perf_counter() - t0)
    return {"steps_per_trial": steps, "samples_per_trial": n, "conditions": results,
            "refresh_median_s": statistics.median(refresh_s), "chart_redraw_median_s": statistics.median(chart_s),
            "monitor_interval_s": interval, "monitor_thread_share": (statistics.median(refresh_s)
                                                                     + statistics.median(chart_s) / 2) / interval}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cpu, cuda, mps (default: get_device())")
    ap.add_argument("--batch", type=int, default=None, help="default 64 on CPU, 256 on a GPU")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (each runs every condition once)")
    ap.add_argument("--trial-seconds", type=float, default=None, help="target epoch length (default 5 CPU, 10 GPU)")
    ap.add_argument("--interval", type=float, default=1.0, help="monitor refresh interval in seconds")
    ap.add_argument("--target", type=float, default=0.02, help="allowed slowdown (default 0.02 = 2 %%)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/monitor_<device>.json)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    device = get_device(args.device)
    gpu = device.type != "cpu"
    batch = args.batch or (256 if gpu else 64)
    trial_seconds = args.trial_seconds or (10.0 if gpu else 5.0)
    info = _stamp(device)
    print(f"monitor overhead benchmark on {info['hardware']}, torch {info['torch']}, device {device}")
    result = run(device, batch, args.rounds, trial_seconds, args.interval)
    c = result["conditions"]
    print(f"throughput (median of {args.rounds}): " + ", ".join(
        f"{k} {v['samples_per_s']:.0f} samples/s" for k, v in c.items()))
    for k in CONDITIONS[1:]:
        print(f"  {k}: {100 * c[k]['slowdown_vs_off']:+.1f} % vs off (paired {100 * c[k]['paired_slowdown_vs_off']:+.1f} %)")
    print(f"monitor refresh {format_seconds(result['refresh_median_s'])}, chart redraw "
          f"{format_seconds(result['chart_redraw_median_s'])}: the thread works "
          f"{100 * result['monitor_thread_share']:.2f} % of the time at a {args.interval:g} s interval")
    within = c["monitor"]["paired_slowdown_vs_off"] <= args.target
    print(f"target: monitor at most {100 * args.target:.0f} % slower (paired) -> {'met' if within else 'NOT met'}")
    record = {"benchmark": "monitor", **info, "batch": batch, "rounds": args.rounds,
              "torch_threads": torch.get_num_threads(), "target_slowdown": args.target, "target_met": within,
              **result,
              "note": "slowdown = condition time / off time - 1; paired = median over rounds of the per-round "
                      "ratio; all conditions interleaved in one run"}
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"monitor_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {os.path.relpath(out)}")
    return record


if __name__ == "__main__":
    main()
