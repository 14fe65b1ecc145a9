"""DDP on this machine: what an all-reduce costs against its size, the overhead of a DistributedDataParallel step,
and the scaling efficiency of 2 processes against 1.

Runs `course_utils.examples.allreduce_cost` under torchrun with 1 process and with 2 (gloo on the CPU, NCCL on a
machine with 2+ GPUs), `--rounds` times in alternation, and keeps medians:
  - all-reduce time and bus bandwidth per tensor size (2 processes);
  - per-step time of SimpleCNN, batch 32 per process: the bare model in 1 process, and DDP in 2 processes; the
    DDP overhead per step is the DDP step minus the bare step measured in the same 2-process run;
  - scaling efficiency: throughput of 2 processes / (2 x throughput of 1), i.e. t(1 process) / t(DDP step).
On a 2-core CPU two processes also compete for the cores (OMP_NUM_THREADS=1 each): the efficiency measures that too.
Then the course Trainer under torchrun against a hand-written DDP loop on an overhead-bound model
(benchmarks/ddp_trainer_worker.py: nn.Linear 32 -> 10, batch 8 per process, epochs alternated, a barrier before
each): the paired ratio of their epoch times, median over rounds (target: at most 1.05), and that both end with the
same weights. Prints the figures and writes benchmarks/results/ddp_<device>.json.

    .venv/bin/python benchmarks/bench_ddp.py [--quick]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from course_utils.timing import stamp  # noqa: E402


def launch(nproc: int, out: Path, quick: bool) -> dict:
    args = ["--out", str(out)] + (["--sizes", "1000,100000,1000000", "--repeats", "5", "--rounds", "2"] if quick
                                  else [])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "course_utils.examples.allreduce_cost", *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    if run.returncode != 0:
        raise RuntimeError(f"torchrun with {nproc} process(es) failed:\n{run.stderr[-3000:]}")
    return json.loads(out.read_text())


def trainer_against_hand(rounds: int, steps: int) -> dict:
    """The Trainer's epoch time over a hand-written DDP loop's, paired per round (2 processes)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "trainer.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(ROOT / "benchmarks" / "ddp_trainer_worker.py"), str(out), str(rounds), str(steps)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        if run.returncode != 0:
            raise RuntimeError(f"the Trainer-against-hand run failed:\n{run.stderr[-3000:]}")
        data = json.loads(out.read_text())
    ratios = sorted(c / h for c, h in zip(data["times"]["course"], data["times"]["hand"]))
    med = statistics.median
    return {"model": "nn.Linear(32, 10), batch 8 per process", "steps_per_epoch": data["steps"],
            "rounds": rounds, "hand_step_s": med(data["times"]["hand"]) / data["steps"],
            "course_step_s": med(data["times"]["course"]) / data["steps"],
            "paired_ratio": {"q1": ratios[len(ratios) // 4], "median": med(ratios),
                             "q3": ratios[(3 * len(ratios)) // 4]},
            "weights_equal": data["weights_equal"], "losses_equal": data["losses"]["hand"] == data["losses"]["course"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    nproc = 2
    ones, twos = [], []
    with tempfile.TemporaryDirectory() as folder:
        for r in range(rounds):
            ones.append(launch(1, Path(folder) / f"one{r}.json", args.quick))
            twos.append(launch(nproc, Path(folder) / f"two{r}.json", args.quick))
    med = statistics.median
    one_step = med(o["step"]["local_seconds"] for o in ones)
    ddp_step = med(t["step"]["ddp_seconds"] for t in twos)
    bare_in_two = med(t["step"]["local_seconds"] for t in twos)
    sizes = [a["numel"] for a in twos[0]["allreduce"]]
    allreduce = [{"numel": n, "bytes": 4 * n,
                  "seconds": med(t["allreduce"][i]["seconds"] for t in twos),
                  "bus_gb_per_s": med(t["allreduce"][i]["bus_gb_per_s"] for t in twos)} for i, n in enumerate(sizes)]
    device = twos[0]["device"]
    result = {"stamp": stamp(torch.device(device.split(":")[0])), "backend": twos[0]["backend"], "processes": nproc,
              "rounds": rounds, "quick": args.quick, "allreduce": allreduce,
              "step": {"model": "SimpleCNN", "gradient_bytes": twos[0]["step"]["gradient_bytes"],
                       "batch_per_process": twos[0]["step"]["batch_per_rank"],
                       "one_process_seconds": one_step, "ddp_seconds": ddp_step,
                       "bare_step_in_ddp_run_seconds": bare_in_two,
                       "ddp_overhead_seconds": ddp_step - bare_in_two,
                       "scaling_efficiency": one_step / ddp_step}}
    print(f"{result['stamp']['hardware']}, backend {result['backend']}, {nproc} processes, {rounds} round(s)")
    print("all-reduce of float32 tensors:")
    for a in allreduce:
        print(f"  {a['bytes'] / 2**20:9.3f} MiB  {a['seconds'] * 1e3:8.3f} ms  bus {a['bus_gb_per_s']:6.2f} GB/s")
    s = result["step"]
    print(f"SimpleCNN step, batch {s['batch_per_process']} per process ({s['gradient_bytes'] / 2**20:.2f} MiB of "
          f"gradients): 1 process {s['one_process_seconds'] * 1e3:.1f} ms; DDP in {nproc} processes "
          f"{s['ddp_seconds'] * 1e3:.1f} ms (the bare step in the same run {s['bare_step_in_ddp_run_seconds'] * 1e3:.1f}"
          f" ms: DDP adds {s['ddp_overhead_seconds'] * 1e3:.1f} ms a step)")
    print(f"scaling efficiency of {nproc} processes: {s['scaling_efficiency']:.2f} "
          f"(throughput {nproc * s['scaling_efficiency']:.2f}x one process)")
    t = trainer_against_hand(rounds=5 if args.quick else 21, steps=200 if args.quick else 400)
    result["trainer_vs_hand"] = t
    r = t["paired_ratio"]
    print(f"Trainer under torchrun against a hand-written DDP loop ({t['model']}, {t['steps_per_epoch']} steps an "
          f"epoch, {t['rounds']} rounds): {t['course_step_s'] * 1e6:.0f} us against {t['hand_step_s'] * 1e6:.0f} us a "
          f"step, paired ratio {r['median']:.3f} [{r['q1']:.3f}, {r['q3']:.3f}] (target <= 1.05); same weights: "
          f"{t['weights_equal']}, same losses: {t['losses_equal']}")
    out = ROOT / "benchmarks" / "results" / f"ddp_{device.split(':')[0]}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
