"""Data parallelism with `torch.distributed`, the way `torchrun` starts it.

`torchrun --nproc-per-node N script.py` starts N copies of the script and gives each the environment variables
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. `Process.from_environment()` reads them, and
`setup()` joins the process group they describe: NCCL between CUDA GPUs (one GPU per local rank), gloo on
CPUs, with a timeout so that a rank that died turns into an error on the others instead of a hang.

The pieces the `Trainer` uses (a plain script that builds a Trainer runs data-parallel under torchrun unchanged):
- `join(device_type)`: this rank's `Process` under torchrun, else a `OneProcess`. Both have the same methods
  (`device_for`, `wrap`, `shard`, `all_sum`, `mean`, `agree`, `gather`, `barrier`, `is_main`), so the Trainer's
  loop never asks whether it runs distributed; the functions below are what a `Process`'s methods call.
- `shard_loader(loader, process)`: the loader of this rank's share of every epoch (a `DistributedSampler` for a
  torch DataLoader, re-shuffled each epoch with `set_epoch`; a rank shard for `TensorLoader`). Its batch size is
  per rank, PyTorch's convention: the global batch is `world_size` times larger.
- `all_sum(values, process)`: sums over ranks (epoch losses and validation metrics are global, the same on every
  rank).
- `StopVote(process)`: whether any rank wants to stop (a Ctrl-C, a SIGTERM or a callback's StopTraining that reached
  only some ranks), agreed without a blocking collective per step: an asynchronous CPU all-reduce about every
  quarter second (or every step, when steps take longer) carries the wishes, and the one posted before, long
  finished by then, is read. Every rank reads the same answers at the same step, so all ranks stop at the same step. `settle()` (at an
  epoch's end) waits for the answer.
- `gather_objects(obj, process)`: one Python object from every rank (the random generators' states).

Importing this module touches no device and starts nothing.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from .errors import learner_stacklevel
from .i18n import _

ENV_TIMEOUT = "COURSE_DIST_TIMEOUT"  # seconds a collective may wait for the other ranks (default 300)
ENV_VOTE_SECONDS = "COURSE_STOP_VOTE_SECONDS"  # about how often ranks agree on a stop (default 0.25; 0: every 8 steps)


@dataclass
class Process:
    """This process's place in a distributed run."""
    rank: int
    world_size: int
    local_rank: int
    backend: str = ""
    cpu_group: object | None = None  # a gloo group for small CPU-side agreements

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints and writes checkpoints."""
        return self.rank == 0

    def device_for(self, device: torch.device) -> torch.device:
        """This rank's device: one GPU per local rank on CUDA, the CPU otherwise."""
        return device_for(self, device.type)

    def wrap(self, model: nn.Module, device: torch.device, sync_batchnorm: bool = False):
        """(the model on `device`, what a training step runs: its DistributedDataParallel wrapper).
        `sync_batchnorm=True` converts BatchNorm layers to SyncBatchNorm first (GPUs only)."""
        if sync_batchnorm:
            if device.type != "cuda":
                raise ValueError(_("sync_batchnorm=True needs CUDA GPUs: SyncBatchNorm runs only on GPU modules "
                                   "(DistributedDataParallel refuses it on {device}); leave it off here").format(
                                       device=device.type))
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # the same parameters, in new modules
        model = model.to(device)  # modules move in place; an optimizer's parameters stay the same objects
        return model, DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    def shard(self, loader):
        """`shard_loader(loader, self)`: this rank's share of every epoch."""
        return shard_loader(loader, self)

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        return all_sum(values, self)

    def mean(self, total: float, count: int) -> float:
        """The mean over all ranks of what this rank summed in `total` over `count` samples: added in float64 on
        the CPU (a round trip), the same on every rank."""
        sums = torch.tensor([total, float(count)], dtype=torch.float64)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.cpu_group)
        total, count = sums.tolist()
        return total / count

    def agree(self, flag: bool) -> bool:
        return agree(flag, self)

    def gather(self, obj) -> list:
        return gather_objects(obj, self)

    def barrier(self) -> None:
        barrier(self)

    def stop_vote(self) -> "StopVote":
        """How the ranks agree on a stop without a blocking round trip per step (`StopVote`)."""
        return StopVote(self)

    @classmethod
    def from_environment(cls, env=None) -> "Process | None":
        """The rank, world size and local rank torchrun set, or None outside a distributed launch (or with
        WORLD_SIZE=1: one process is not distributed)."""
        env = os.environ if env is None else env
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        world = int(env["WORLD_SIZE"])
        if world < 2:
            return None
        return cls(int(env["RANK"]), world, int(env.get("LOCAL_RANK", env["RANK"])))


class OneProcess:
    """A run in one process, with the methods of a distributed `Process`, each doing the one-process thing
    (nothing to wrap, shard, sum or agree on), so that a training loop calls them without asking which it has."""

    rank, world_size, local_rank, backend, is_main = 0, 1, 0, "", True

    def device_for(self, device: torch.device) -> torch.device:
        return device

    def wrap(self, model: nn.Module, device: torch.device, sync_batchnorm: bool = False):
        """(the model on `device`, the same model: one process trains the module itself). sync_batchnorm has
        nothing to synchronise with in one process."""
        model = model.to(device)
        return model, model

    def shard(self, loader):
        return loader

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def mean(self, total: float, count: int) -> float:
        return total / count

    def agree(self, flag: bool) -> bool:
        return flag

    def gather(self, obj) -> list:
        return [obj]

    def barrier(self) -> None:
        pass

    def stop_vote(self) -> "Alone":
        return Alone()

    def __repr__(self) -> str:
        return "OneProcess()"


class Alone:
    """The stop vote of one process: its wish is the answer, at once."""

    def __call__(self, wish: int) -> int:
        return wish

    def settle(self, wish: int = 0) -> int:
        return wish


def join(device_type: str | None = None) -> "Process | OneProcess":
    """`setup(device_type)` under torchrun (this rank of the launch), else a `OneProcess`: the same methods."""
    return setup(device_type) or OneProcess()


def timeout_seconds() -> float:
    return float(os.environ.get(ENV_TIMEOUT, "300"))


def setup(device_type: str | None = None) -> "Process | None":
    """Join the process group torchrun describes (once per process) and return this process's place in it.

    `device_type`: "cuda" for NCCL with one GPU per local rank, "cpu" for gloo; default: CUDA if this machine
    has a GPU for every local process, else the CPU. Asking for CUDA with fewer GPUs than processes is an error.
    Returns None when the script was not launched as several processes.
    """
    process = Process.from_environment()
    if process is None:
        return None
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", process.world_size))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device_type is None:
        device_type = "cuda" if gpus >= local_world else "cpu"
    if device_type == "cuda" and gpus < local_world:
        raise RuntimeError(_("torchrun started {processes} processes on this machine, but it has {gpus} CUDA GPU(s), "
                             "and data parallelism runs one process per GPU: start at most {gpus} "
                             "(--nproc-per-node), or train on the CPU (device='cpu', gloo) to try it out").format(
            processes=local_world, gpus=gpus))
    process.backend = "nccl" if device_type == "cuda" else "gloo"
    _refuse_restarts_on_a_shared_store()
    if not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(process.local_rank)
        dist.init_process_group(process.backend, timeout=timedelta(seconds=timeout_seconds()))
        sys.excepthook = _note_failure(sys.excepthook)
        atexit.register(_destroy)
    elif dist.get_world_size() != process.world_size:
        raise RuntimeError(_("a process group of {ranks} ranks exists, but WORLD_SIZE says {world_size}").format(
            ranks=dist.get_world_size(), world_size=process.world_size))
    process.backend = dist.get_backend()
    # a gloo group of its own for small CPU-side agreements: they never wait behind gradients or for a GPU
    process.cpu_group = dist.new_group(backend="gloo")
    return process


SHARED_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # torchrun's switch: a fresh rendezvous store per attempt


def _refuse_restarts_on_a_shared_store() -> None:
    """torchrun --max-restarts with its default shared store: refuse in the first attempt, with the fix.

    Since torch 2.5 torchrun's c10d rendezvous shares its TCP store with the workers' process group
    (TORCHELASTIC_USE_AGENT_STORE=True), and the store outlives a restart: the restarted workers find the
    addresses the previous attempt's workers left there and connect to dead ports (gloo: "Connection refused", or
    a hang in new_group; pytorch/pytorch#135712 for NCCL). With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the
    launcher's environment every attempt builds a store of its own. Failing here, before any training, costs
    nothing; failing at the first restart would lose the run that the restarts were meant to save."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and \
            int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        raise RuntimeError(_("torchrun was asked for restarts (--max-restarts {restarts}), but it shares its "
                             "rendezvous store with the workers, and that store outlives a restart: the restarted "
                             "processes would connect to the addresses of the processes that died and fail. Launch "
                             "with {switch}=1 in torchrun's environment ({switch}=1 torchrun --max-restarts "
                             "{restarts} ...), which gives every attempt a store of its own").format(
            restarts=os.environ["TORCHELASTIC_MAX_RESTARTS"], switch=SHARED_STORE_OFF))


_failed = False


def _note_failure(hook):
    def excepthook(*exc_info):
        global _failed
        _failed = True
        hook(*exc_info)
    return excepthook


def _destroy() -> None:
    """At exit: wait for the other ranks (so none tears its connections down while another still uses them),
    then leave the group. After an uncaught exception, leave at once: torchrun stops the others."""
    if not dist.is_initialized():
        return
    if not _failed:
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=30))
            else:
                dist.barrier()
        except Exception:  # a rank is gone already: nothing left to wait for
            pass
    dist.destroy_process_group()


def device_for(process: Process, device_type: str) -> torch.device:
    """One GPU per local rank on CUDA; the CPU otherwise."""
    return torch.device("cuda", process.local_rank) if device_type == "cuda" else torch.device("cpu")


def shard_loader(loader, process: Process):
    """`loader` restricted to this rank's share of each epoch.

    - a `TensorLoader`: `loader.shard(rank, world_size)` (every rank draws the same permutation, from the same
      seed, and takes every world_size-th sample of it);
    - a torch DataLoader over a map-style dataset with a shuffling or sequential sampler: the same loader built
      again with a `DistributedSampler` (same shuffling, seeded with rank 0's loader generator's seed on every
      rank, so the shares come from one permutation and never overlap; a warning if the ranks' seeds differ;
      padded, as PyTorch does, so every rank gets the same number of batches). A DataLoader that already has a
      DistributedSampler is kept. torchdata's StatefulDataLoader (shuffled or not) is rebuilt the same way.
    - a DataLoader over an `IterableDataset` (a stream has no sampler to split): the same loader over
      `dataset.shard(rank, world_size)`, a method the dataset provides (it yields only that rank's share, split
      further by worker with `torch.utils.data.get_worker_info()`, and the same number of batches on every rank).
    Anything else raises: a rank must not silently train on the data of all ranks.
    """
    shard = getattr(loader, "shard", None)
    if callable(shard):
        return shard(process.rank, process.world_size)
    if isinstance(loader, DataLoader) and isinstance(loader.dataset, IterableDataset):
        return _shard_stream(loader, process)
    if not isinstance(loader, DataLoader) and not hasattr(loader, "sampler"):
        raise TypeError(_("cannot split a {loader} across {ranks} ranks: pass a course_utils.data.TensorLoader or a "
                          "torch DataLoader, or give every rank its own share through a DataLoader with a "
                          "DistributedSampler").format(loader=type(loader).__name__, ranks=process.world_size))
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        return loader
    shuffle = _shuffles(sampler)
    if not (shuffle or isinstance(sampler, SequentialSampler)) or loader.batch_sampler is None:
        raise TypeError(_("this DataLoader uses a {sampler}: build it with a torch.utils.data.DistributedSampler "
                          "yourself so that each rank draws its own share").format(sampler=type(sampler).__name__))
    # The ranks' shares must come from one permutation: every rank shuffles with rank 0's seed (a collective:
    # every rank builds its Trainer, and so its loaders, in the same order).
    seeds = gather_objects(loader.generator.initial_seed() if loader.generator is not None else 0, process)
    if shuffle and len(set(seeds)) > 1:
        warnings.warn(_("the ranks' DataLoaders have generators seeded differently ({seeds}): each rank's share "
                        "must come from one shuffle, or the shares would overlap, so every rank shuffles with rank "
                        "0's seed ({seed}). The loader's own generator still seeds its workers, per rank.").format(
            seeds=", ".join(map(str, seeds)), seed=seeds[0]), stacklevel=learner_stacklevel())
    distributed = DistributedSampler(loader.dataset, num_replicas=process.world_size, rank=process.rank,
                                     shuffle=shuffle, seed=seeds[0])
    return _rebuild(loader, loader.dataset, sampler=distributed)


def _shuffles(sampler) -> bool:
    """Whether `sampler` is a shuffling sampler the Trainer may replace: torch's RandomSampler, or torchdata's
    (what StatefulDataLoader(shuffle=True) makes)."""
    if isinstance(sampler, RandomSampler):
        return True
    try:
        from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler
    except ImportError:
        return False
    return isinstance(sampler, StatefulRandomSampler)


def _rebuild(loader: DataLoader, dataset, **extra) -> DataLoader:
    """`loader` built again over `dataset`, with the same settings (and `extra`)."""
    kwargs = dict(batch_size=loader.batch_size, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                  pin_memory=loader.pin_memory, drop_last=loader.drop_last, timeout=loader.timeout,
                  worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
                  generator=loader.generator, persistent_workers=loader.persistent_workers, **extra)
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "snapshot_every_n_steps"):  # torchdata's StatefulDataLoader
        kwargs["snapshot_every_n_steps"] = loader.snapshot_every_n_steps
    return type(loader)(dataset, **kwargs)


def _shard_stream(loader: DataLoader, process: Process) -> DataLoader:
    """A DataLoader over an IterableDataset, rebuilt over the dataset's own `shard(rank, world_size)`."""
    shard = getattr(loader.dataset, "shard", None)
    if not callable(shard):
        raise TypeError(_(
            "cannot split a DataLoader over an IterableDataset ({dataset}) across {ranks} ranks: a stream has no "
            "sampler, so DistributedSampler cannot be used. Give {dataset} a method shard(rank, world_size) that "
            "returns the dataset of that rank's share: in __iter__, keep every world_size-th item starting at rank "
            "(and split that again by DataLoader worker with torch.utils.data.get_worker_info()), with the same "
            "number of batches on every rank. The Trainer calls it.").format(
            dataset=type(loader.dataset).__name__, ranks=process.world_size))
    return _rebuild(loader, shard(process.rank, process.world_size))


def all_sum(values: torch.Tensor, process: Process | None) -> torch.Tensor:
    """`values` summed over all ranks (the same result on every rank); unchanged outside a distributed run."""
    if process is None or process.world_size == 1:
        return values
    values = values.clone()
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def largest(value: int, process: Process | None) -> int:
    """The largest `value` over all ranks (the same on every rank): a blocking CPU all-reduce, for rare points
    (a stop, an epoch's end)."""
    if process is None or process.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=process.cpu_group)
    return int(t.item())


def agree(flag: bool, process: Process | None) -> bool:
    """True on every rank if `flag` is True on any rank (a blocking round trip)."""
    return bool(largest(int(flag), process))


class StopVote:
    """Whether any rank wants to stop, agreed by all ranks without waiting at every step.

        vote = StopVote(process)
        wish = vote(local_wish)   # every step: this rank's wish in, the agreed one out (0 most of the time)
        wish = vote.settle(local_wish)   # an epoch's end: wait for everything posted, and this wish too

    A wish is an int (0: go on; larger wins: 1 StopTraining, 2 Ctrl-C). Every `every` calls, the wishes made
    since the last post go out in an asynchronous all-reduce (MAX) on a CPU group of its own, and the answer of
    the post before, finished long ago, is read: no blocking round trip. A post is not free on a busy CPU (its
    thread competes with the gradient all-reduce for the cores), so the interval adapts: each post also
    proposes how many steps fill about `seconds` (default 0.25 s; every step when a step takes longer), and from
    the answer on all ranks use the largest proposal. All ranks make the same calls and read the same answers at
    the same call, so they stop together: about 2 x `seconds` after the wish, or 2 steps when steps are slower,
    from the first step of a launch on (a SIGTERM's save then lands within torchrun's --shutdown-timeout grace
    period unless a step takes that long). The first steps vote every step, until the interval is measured.
    `seconds=None` keeps `every` fixed (the environment variable COURSE_STOP_VOTE_SECONDS=0 does the same, for tests that
    need the stop at a known step). In one process `Alone` stands in: a wish is its own answer, at once.
    """

    MAX_EVERY = 4096  # steps: a bound on the interval whatever a step costs

    def __init__(self, process: Process, every: int = 8, seconds: float | None = None):
        if seconds is None:
            seconds = float(os.environ.get(ENV_VOTE_SECONDS, "0.25"))
        self.process = process
        self.seconds = seconds if seconds and seconds > 0 else None
        self.least = 1 if self.seconds else every  # timed: slow steps vote every step; fixed: every `every`
        # timed: every step until the first proposal (the third call) says how many steps fill `seconds`, so a
        # stop early in a launch is as prompt as later (with `every` steps first, it took 2 x `every` steps)
        self.every = self.least
        self._left = self.every  # calls until the next post
        self._wish = 0        # the largest wish made since the last post
        self._pending = None  # (work, tensor) of the last posted wish
        self._posted_at: float | None = None  # when the last post went out (None: not timed since a settle)

    def _proposal(self, steps: int) -> int:
        """The interval this rank proposes: how many steps fill about `seconds`, from the `steps` since the last
        post."""
        now = time.perf_counter()
        proposal = 0  # 0: no proposal (nothing timed yet)
        if self.seconds is not None and self._posted_at is not None and now > self._posted_at:
            step = (now - self._posted_at) / steps
            proposal = min(self.MAX_EVERY, max(self.least, int(self.seconds / step)))
        self._posted_at = now
        return proposal

    def _post(self, wish: int, proposal: int = 0) -> None:
        t = torch.tensor([wish, proposal], dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process.cpu_group, async_op=True)
        self._pending = (work, t)

    def _read(self) -> int:
        if self._pending is None:
            return 0
        work, t = self._pending
        self._pending = None
        work.wait()  # posted `every` steps ago on every rank: done already, nothing to wait for
        wish, proposal = t.tolist()
        if proposal:
            self.every = proposal  # the same answer on every rank: they change the interval at the same call
        return wish

    def __call__(self, wish: int) -> int:
        self._wish = max(self._wish, wish)
        self._left -= 1
        if self._left > 0:
            return 0
        steps = self.every  # the interval that just ran out (reading may change it)
        agreed = self._read()
        self._post(self._wish, self._proposal(steps))
        self._wish = 0
        self._left = self.every
        return agreed

    def settle(self, wish: int = 0) -> int:
        """The agreed wish, counting everything posted so far and `wish`: a blocking round trip."""
        agreed = self._read()
        latest = largest(max(self._wish, wish), self.process)
        self._wish, self._left, self._posted_at = 0, self.every, None
        return max(agreed, latest)


def gather_objects(obj, process: Process | None) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank; [obj] outside a distributed run."""
    if process is None or process.world_size == 1:
        return [obj]
    out = [None] * process.world_size
    dist.all_gather_object(out, obj, group=process.cpu_group)
    return out


def barrier(process: Process | None) -> None:
    if process is not None and process.world_size > 1:
        dist.barrier(group=process.cpu_group)
