"""Peers: per-step overhead of training frameworks against a hand-written PyTorch loop, on the CPU.

Contenders, each training one epoch of the same steps (same initial weights, same batches in the same order,
SGD with momentum, cross-entropy) and each computing the epoch's mean loss with no CPU-GPU sync per step (the
loss summed on the device, one `.item()` at the end of the epoch; the Trainer instead keeps each batch's loss on
the device and reads them all at the end with one `.tolist()`, which names a first non-finite batch, and which
the CPU profiler's host-read count below does not see: its 0 is that one read):
  hand        the hand-written loop (zero_grad(set_to_none=True), forward, loss, backward, step)
  course      course_utils.Trainer(model, optimizer, loss_fn, loader, device="cpu")(1)
  course_oom  the same with oom_recovery=True, when nothing runs out (ratio to course printed: target <= 1.03)
  lightning   lightning.pytorch.Trainer(max_epochs=1, ...).fit(LightningModule, dataloader)
  fabric      lightning.fabric.Fabric(accelerator="cpu", devices=1): setup(model, optimizer), fabric.backward
  accelerate  accelerate.Accelerator(cpu=True): prepare(model, optimizer, dataloader), accelerator.backward
on two models:
  linear      one nn.Linear(32 -> 10), batch 8, 1000 steps an epoch: the step is almost all overhead
  cnn         course_utils.models.SimpleCNN on synthetic_digits, batch 64, 1024 images (16 steps) an epoch
  bn          Linear 32->64, BatchNorm1d, ReLU, Linear 64->10, batch 8, 1000 steps: overhead-bound, with buffers

Data, already in memory (no per-sample indexing or collation anywhere):
  hand, course, fabric   a course_utils.data.TensorLoader(shuffle=False): each batch is a slice (a view)
  lightning, accelerate  torch DataLoader(list of those same slices, batch_size=None): one list lookup per batch
The cost of iterating each loader alone is measured and printed, so one can see it is not what differs.

Method: torch.set_num_threads(1) for every contender (stable on a small busy machine, and it is the per-step
Python overhead we are after; --threads to change it); a warm-up round, then R rounds, each running every
contender once in an order rotated by one per round. Per contender: the median epoch time, and the PAIRED ratio:
per round contender time / hand time of that round, median (and quartiles) over rounds; per-step overhead is the
paired median of (contender - hand) / steps. Lightning builds a new pl.Trainer every epoch (max_epochs=1) outside
the timed region; the timed fit() still includes its per-fit setup and teardown, estimated separately from a
1-batch fit. Afterwards: every contender's weights must equal the hand loop's (same steps ran), and one extra
epoch each under torch.profiler counts host reads of tensor values (aten::_local_scalar_dense: .item(), bool(),
float() ... each one would be a CPU-GPU sync on a GPU). Prints a table per model and writes
benchmarks/results/peers_cpu.json.

    .venv/bin/pip install -r benchmarks/requirements.txt   # lightning, accelerate (benchmark only)
    .venv/bin/python benchmarks/bench_peers.py [--quick] [--rounds 9] [--threads 1]
"""
import argparse
import copy
import importlib
import json
import logging
import os
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from course_utils import Trainer
from course_utils.data import TensorLoader, synthetic_digits
from course_utils.models import SimpleCNN
from course_utils.timing import stamp, synchronize

ROOT = Path(__file__).resolve().parents[1]
DEVICE = torch.device("cpu")
LR, MOMENTUM = 0.05, 0.9


def optional(module: str):
    """The module, or None with a one-line note if it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        print(f"note: {module} is not installed ({exc}); skipping it "
              "(pip install -r benchmarks/requirements.txt)")
        return None


warnings.filterwarnings("ignore")  # Lightning's hints (num_workers, log_every_n_steps) are not about overhead
pl = optional("lightning.pytorch")
lfabric = optional("lightning.fabric")
accelerate = optional("accelerate")
for _name in ("lightning.pytorch", "lightning.fabric"):  # after the imports, which set these loggers to INFO
    logging.getLogger(_name).setLevel(logging.ERROR)


# --- the contenders -----------------------------------------------------------------------------
# Each contender owns its model copy and optimizer for the whole run (momentum buffers carry over between
# epochs, as in a real run); `prepare()` is untimed work before an epoch, `run()` is the timed epoch and returns
# its mean loss (one .item()), `model` is the plain nn.Module whose weights are compared with the hand loop's.

class Hand:
    def __init__(self, model, loader):
        self.model, self.loader = model, loader
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        self.loss_fn = nn.CrossEntropyLoss()

    def prepare(self):
        pass

    def run(self):
        model, optimizer, loss_fn = self.model, self.optimizer, self.loss_fn
        model.train()
        total, count = torch.zeros((), device=DEVICE), 0
        for x, y in self.loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total.add_(loss.detach(), alpha=len(y))  # one fused op, as the Trainer's
            count += len(y)
        return (total / count).item()


class Course:
    def __init__(self, model, loader, **options):
        self.model = model
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        self.trainer = Trainer(model, optimizer, nn.CrossEntropyLoss(), loader, device="cpu", **options)

    def prepare(self):
        pass

    def run(self):
        return self.trainer(1)[0]


if pl is not None:
    class PeerModule(pl.LightningModule):
        """The model, its optimizer and the device-side running loss sum (reset at the start of each fit)."""

        def __init__(self, model):
            super().__init__()
            self.model = model
            self.loss_fn = nn.CrossEntropyLoss()
            self.optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
            self.total, self.count = None, 0

        def on_train_epoch_start(self):
            self.total, self.count = torch.zeros((), device=self.device), 0

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.loss_fn(self.model(x), y)
            self.total.add_(loss.detach(), alpha=len(y))  # one fused op, as the Trainer's
            self.count += len(y)
            return loss

        def configure_optimizers(self):
            return self.optimizer  # the same optimizer object every fit: its momentum carries over


class Lightning:
    """A fresh pl.Trainer(max_epochs=1) per epoch, built in prepare() (untimed); run() times fit() + .item()."""

    def __init__(self, model, batches, limit_train_batches=1.0):
        self.model = model
        self.module = PeerModule(model)
        self.loader = torch.utils.data.DataLoader(batches, batch_size=None)  # pre-made batches, no collation
        self.limit = limit_train_batches
        self.trainer = None

    def prepare(self):
        self.trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                                  enable_checkpointing=False, enable_progress_bar=False,
                                  enable_model_summary=False, num_sanity_val_steps=0,
                                  limit_train_batches=self.limit)

    def run(self):
        self.trainer.fit(self.module, train_dataloaders=self.loader)
        return (self.module.total / self.module.count).item()


class FabricLoop:
    def __init__(self, model, loader):
        self.model, self.loader = model, loader
        self.fabric = lfabric.Fabric(accelerator="cpu", devices=1)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        self.fmodel, self.optimizer = self.fabric.setup(model, optimizer)
        self.loss_fn = nn.CrossEntropyLoss()

    def prepare(self):
        pass

    def run(self):
        fabric, model, optimizer, loss_fn = self.fabric, self.fmodel, self.optimizer, self.loss_fn
        model.train()
        total, count = torch.zeros((), device=fabric.device), 0
        for x, y in self.loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            total.add_(loss.detach(), alpha=len(y))  # one fused op, as the Trainer's
            count += len(y)
        return (total / count).item()


_ACCELERATOR = None


class AccelerateLoop:
    def __init__(self, model, batches):
        global _ACCELERATOR
        if _ACCELERATOR is None:  # one Accelerator for the process (its state is process-wide anyway)
            _ACCELERATOR = accelerate.Accelerator(cpu=True)
        self.acc = _ACCELERATOR
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        loader = torch.utils.data.DataLoader(batches, batch_size=None)  # pre-made batches, no collation
        self.pmodel, self.optimizer, self.loader = self.acc.prepare(model, optimizer, loader)
        self.model = model
        self.loss_fn = nn.CrossEntropyLoss()

    def prepare(self):
        pass

    def run(self):
        acc, model, optimizer, loss_fn = self.acc, self.pmodel, self.optimizer, self.loss_fn
        model.train()
        total, count = torch.zeros((), device=acc.device), 0
        for x, y in self.loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            acc.backward(loss)
            optimizer.step()
            total.add_(loss.detach(), alpha=len(y))  # one fused op, as the Trainer's
            count += len(y)
        return (total / count).item()


# --- measurement ------------------------------------------------------------------------------------

def quartiles(xs):
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, statistics.median(xs), q3


def loader_cost(loader, repeats=5):
    """Seconds per batch to iterate a loader and do nothing with the batches (median of `repeats` passes)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = sum(1 for _ in loader)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def host_reads(c) -> int:
    """aten::_local_scalar_dense calls (host reads of a tensor's value) during one epoch of contender c."""
    from torch.profiler import ProfilerActivity, profile
    c.prepare()
    saved = os.dup(2)  # the profiler's start/stop lines go straight to file descriptor 2: hide them
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            c.run()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense")


def bench_model(name, make_model, images, labels, batch, rounds, threads):
    torch.manual_seed(0)
    init = make_model()
    tensor_loader = lambda: TensorLoader(images, labels, batch_size=batch, shuffle=False)  # noqa: E731
    batches = list(tensor_loader())  # the very same slices, for the frameworks that want a DataLoader
    steps = len(batches)
    makers = {"hand": lambda m: Hand(m, tensor_loader()), "course": lambda m: Course(m, tensor_loader()),
              # the OOM-resilient step when nothing runs out: what it costs to be ready (it copies BatchNorm's
              # running statistics before each forward, to put them back if the step has to run again)
              "course_oom": lambda m: Course(m, tensor_loader(), oom_recovery=True)}
    if pl is not None:
        makers["lightning"] = lambda m: Lightning(m, batches)
    if lfabric is not None:
        makers["fabric"] = lambda m: FabricLoop(m, tensor_loader())
    if accelerate is not None:
        makers["accelerate"] = lambda m: AccelerateLoop(m, batches)
    contenders = {k: make(copy.deepcopy(init)) for k, make in makers.items()}
    names = list(contenders)
    torch.set_num_threads(threads)  # again, in case a framework's constructor changed it

    losses = {k: [] for k in names}
    times = {k: [] for k in names}

    def timed(k):
        c = contenders[k]
        c.prepare()
        if torch.get_num_threads() != threads:
            raise RuntimeError(f"{k} changed torch's thread count to {torch.get_num_threads()}")
        synchronize(DEVICE)
        t0 = time.perf_counter()
        loss = c.run()
        synchronize(DEVICE)
        losses[k].append(loss)
        return time.perf_counter() - t0

    for k in names:  # warm-up round, not timed
        timed(k)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate: each contender in every position
        for k in order:
            times[k].append(timed(k))

    # same steps ran: final weights equal to the hand loop's
    ref = contenders["hand"].model.state_dict()
    checks = {}
    for k in names:
        sd = contenders[k].model.state_dict()
        diff = max((sd[p] - ref[p]).abs().max().item() for p in ref)
        close = all(torch.allclose(sd[p], ref[p], rtol=0, atol=1e-6) for p in ref)
        checks[k] = {"weights_allclose_atol_1e-6": close, "weights_max_abs_diff": diff,
                     "losses_max_abs_diff": max(abs(a - b) for a, b in zip(losses[k], losses["hand"]))}

    # extras, after the check (they train further): host reads per epoch, loader cost, Lightning's per-fit cost
    reads = {k: host_reads(contenders[k]) for k in names}
    loaders = {"TensorLoader (hand, course, fabric)": loader_cost(tensor_loader()),
               "DataLoader(batches, batch_size=None)": loader_cost(torch.utils.data.DataLoader(batches,
                                                                                               batch_size=None))}
    if accelerate is not None:
        loaders["accelerate-prepared DataLoader"] = loader_cost(contenders["accelerate"].loader)
    fit_fixed = None
    if pl is not None:  # a 1-batch fit on a throwaway copy, minus one hand-loop step: what fit() costs per call
        one = Lightning(copy.deepcopy(init), batches, limit_train_batches=1)
        one_times = []
        for _ in range(4):
            one.prepare()
            t0 = time.perf_counter()
            one.run()
            one_times.append(time.perf_counter() - t0)
        fit_fixed = statistics.median(one_times[1:]) - statistics.median(times["hand"]) / steps

    hand = times["hand"]
    rows = {}
    for k in names:
        ratios = [t / h for t, h in zip(times[k], hand)]
        to_course = quartiles([t / c for t, c in zip(times[k], times["course"])])
        overhead = [(t - h) / steps for t, h in zip(times[k], hand)]
        q1, med, q3 = quartiles(ratios)
        rows[k] = {"epoch_s": times[k], "median_epoch_s": statistics.median(times[k]),
                   "median_step_s": statistics.median(times[k]) / steps,
                   "paired_ratio_to_hand": {"q1": q1, "median": med, "q3": q3},
                   "paired_ratio_to_course": dict(zip(("q1", "median", "q3"), to_course)),
                   "paired_overhead_per_step_s": statistics.median(overhead),
                   "host_reads_per_epoch": reads[k], "epoch_losses": losses[k], **checks[k]}

    print(f"\n{name}: {steps} steps of batch {batch} per epoch, {rounds} rounds, {threads} thread(s)")
    print(f"  {'contender':<11} {'ms/epoch':>9} {'us/step':>9} {'ratio to hand [q1, q3]':>26} "
          f"{'overhead us/step':>17} {'host reads':>11}  weights")
    for k, row in rows.items():
        r = row["paired_ratio_to_hand"]
        if not row["weights_allclose_atol_1e-6"]:
            ok = f"MISMATCH (max diff {row['weights_max_abs_diff']:.2e})"
        else:
            ok = "== hand" + (" (bit-identical)" if row["weights_max_abs_diff"] == 0 else "")
        print(f"  {k:<11} {row['median_epoch_s'] * 1e3:9.1f} {row['median_step_s'] * 1e6:9.1f} "
              f"{r['median']:10.3f} [{r['q1']:.3f}, {r['q3']:.3f}] "
              f"{row['paired_overhead_per_step_s'] * 1e6:17.1f} {row['host_reads_per_epoch']:11d}  {ok}")
    r = rows["course_oom"]["paired_ratio_to_course"]
    print(f"  oom_recovery=True with no OOM / oom_recovery=False (paired): {r['median']:.3f} "
          f"[{r['q1']:.3f}, {r['q3']:.3f}] (target <= 1.03)")
    print("  loader alone, us/batch: " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in loaders.items()))
    if fit_fixed is not None:
        print(f"  lightning fit() fixed cost (1-batch fit minus one hand step): {fit_fixed * 1e3:.1f} ms per epoch, "
              f"{fit_fixed / steps * 1e6:.1f} us of the overhead per step above")
    for k, row in rows.items():
        if not row["weights_allclose_atol_1e-6"]:
            print(f"  !! {k}: final weights differ from the hand loop's (max abs diff "
                  f"{row['weights_max_abs_diff']:.3e}): it did not run the same steps")
    return {"steps_per_epoch": steps, "batch_size": batch, "images": len(labels), "rounds": rounds,
            "contenders": rows, "loader_s_per_batch": loaders, "lightning_fit_fixed_s": fit_fixed}


def main(quick: bool, rounds: int | None, threads: int):
    torch.set_num_threads(threads)
    rounds = rounds or (3 if quick else 9)
    linear_steps = 500 if quick else 1000
    cnn_images = 256 if quick else 1024
    t_start = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    lin_x = torch.randn(linear_steps * 8, 32, generator=g)
    lin_y = torch.randint(0, 10, (linear_steps * 8,), generator=g)
    digits = synthetic_digits(cnn_images, seed=0)
    versions = {"torch": torch.__version__}
    for label, mod in (("lightning", pl and importlib.import_module("lightning")), ("accelerate", accelerate)):
        versions[label] = getattr(mod, "__version__", None) if mod is not None else None
    print("versions: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in versions.items()))
    result = {
        "stamp": stamp(DEVICE), "quick": quick, "threads": threads, "versions": versions,
        "method": "warm-up round, then rounds with every contender once in rotated order; paired ratio = "
                  "median over rounds of contender/hand epoch time; overhead = paired median (contender-hand)/steps",
        "skipped": [k for k, v in versions.items() if v is None],
        "models": {
            "linear": bench_model("linear (nn.Linear 32->10)", lambda: nn.Linear(32, 10), lin_x, lin_y, 8,
                                  rounds, threads),
            "cnn": bench_model("cnn (SimpleCNN, synthetic digits)", SimpleCNN, digits.images, digits.labels, 64,
                               rounds, threads),
            # overhead-bound with BatchNorm: the case where oom_recovery=True has buffers to copy every step
            "bn": bench_model("bn (Linear 32->64, BatchNorm1d, ReLU, Linear 64->10)",
                              lambda: nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10)),
                              lin_x, lin_y, 8, rounds, threads),
        },
    }
    result["wall_s"] = time.perf_counter() - t_start
    print(f"\ntotal {result['wall_s']:.0f} s")
    out = ROOT / "benchmarks" / "results" / "peers_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="a ~30 s smoke run: 3 rounds, shorter epochs")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 9, 3 with --quick)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for every contender")
    a = p.parse_args()
    main(a.quick, a.rounds, a.threads)
