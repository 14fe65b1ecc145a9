"""Exercises of notebook 08, "More than one GPU".

08.1 the learning rate of a configuration (global batch, linear scaling, warm-up), 08.2 shard a dataset by rank
(every sample on a rank, the same count on every rank), 08.3 gradient accumulation under DDP with `no_sync()`
(checked on a process group of one process in this process, all-reduces counted with a comm hook, then run again
with torch.distributed.get_world_size() answering 2: the update must not depend on it), 08.4 which
snippets make the replicas drift apart (the key is checked for real on 2 processes by tests/test_nb08_demos.py), 08.5 the
number of steps between checkpoints for a failure rate and a save's cost (Young's approximation), judged by the
exact expected time lost (course_utils.failures, which tests/test_failures.py checks against a simulation).
"""
from __future__ import annotations

import contextlib
import math
import numbers
import os
import tempfile
from collections import Counter
from unittest import mock

import numpy as np
import torch
from torch import nn

from .. import failures
from ..i18n import N_, _
from .core import Exercise, Incorrect, Mistake, as_float, call, describe, real_item, register
from .probe import fresh_random, observe

# --- 08.2 shard a dataset by rank --------------------------------------------------------------------


def reference_shards(n: int, world_size: int) -> list[list[int]]:
    """DistributedSampler(shuffle=False)'s split of range(n): padded by wrapping around, then interleaved."""
    total = math.ceil(n / world_size) * world_size
    indices = list(range(n))
    while len(indices) < total:
        indices += indices[: total - len(indices)]
    return [indices[rank:total:world_size] for rank in range(world_size)]


def _as_index_list(value, label: str) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise Incorrect(_("{label} returned {value}; return a list of int sample indices").format(
                label=label, value=describe(value)))
        return value.tolist()
    if not isinstance(value, (list, tuple, range)):
        raise Incorrect(_("{label} returned {value}; return a list of int sample indices").format(
            label=label, value=describe(value)))
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.dtype.is_floating_point:
                v = int(v)
            else:
                raise Incorrect(_("{label} returned a list holding {value}; every item should be an int index").format(
                    label=label, value=describe(v)))
        out.append(int(v))
    return out


# the first is large: a random answer cannot repeat itself between two calls by chance; (2, 5): fewer samples than
# half the ranks, one wrap-around is not enough
_SHARD_CASES = [(100, 8), (10, 4), (8, 2), (7, 3), (3, 4), (1, 2), (9, 2), (2, 5)]


def _check_shard_indices(shard_indices):
    if not observe(lambda: callable(shard_indices)):
        raise Incorrect(_("shard_indices should be a function, got {value}").format(
            value=observe(lambda: describe(shard_indices))))
    # Unseeded draws from torch's generator (a mistake) start from the same state at every check, so the same
    # answer gets the same feedback; the generator is put back as it was afterwards.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(0)
        return _check_shards(shard_indices)


def _check_shards(shard_indices):
    like_sampler = True
    for n, world in _SHARD_CASES:
        shards = []
        for rank in range(world):
            label = f"shard_indices({n}, {rank}, {world})"
            first = observe(lambda: _as_index_list(call(shard_indices, n, rank, world, name="shard_indices"), label))
            again = observe(lambda: _as_index_list(call(shard_indices, n, rank, world, name="shard_indices"), label))
            if first != again:
                raise Incorrect(_("{label} returned {first}... then {again}...: the result differs between "
                                  "two calls. Every rank must compute its share on its own and agree with the others "
                                  "without talking to them: no unseeded randomness").format(
                                      label=label, first=first[:6], again=again[:6]))
            bad = [i for i in first if not 0 <= i < n]
            if bad:
                raise Incorrect(_("{label} returned index {index}, outside range({n})").format(
                    label=label, index=bad[0], n=n))
            shards.append(first)
        expected = reference_shards(n, world)
        per_rank = math.ceil(n / world)
        counts = [len(s) for s in shards]
        where = _("for n={n} samples on {world} ranks").format(n=n, world=world)
        if all(sorted(s) == list(range(n)) for s in shards) and n > 1:
            raise Incorrect(_("{where}, every rank gets all {n} samples: each rank would train on the whole "
                              "dataset, so one step sees the data world_size times; give each rank its own share").format(
                                  where=where, n=n))
        once = list(range(n)) + list(range(n))[: math.ceil(n / world) * world - n]  # wrapped around only once
        if len(set(counts)) > 1 and shards == [once[rank::world] for rank in range(world)]:
            raise Incorrect(_("{where}, the ranks get {counts} samples: unequal counts, because the list was "
                              "wrapped around only once: with fewer samples than half the ranks, {n} + {n} is "
                              "still short of {total}; keep appending the first samples until the list holds "
                              "ceil(n / world_size) x world_size = {total}").format(
                where=where, counts=counts, n=n, total=math.ceil(n / world) * world))
        if len(set(counts)) > 1:
            raise Incorrect(_("{where}, the ranks get {counts} samples: unequal counts. With batches, one rank "
                              "then runs more steps than another, and its last backward waits for an all-reduce the "
                              "other ranks never join: a hang. Pad the list to a multiple of world_size by wrapping "
                              "around (the first samples again), as DistributedSampler does").format(
                                  where=where, counts=counts))
        covered = set().union(*map(set, shards))
        missing = sorted(set(range(n)) - covered)
        if missing and counts[0] < per_rank:
            raise Incorrect(_("{where}, every rank gets {count} samples and samples {missing} are on no rank: "
                              "the code drops the remainder. Each rank should get ceil(n / world_size) = {per_rank}, "
                              "the list padded by wrapping around").format(
                                  where=where, count=counts[0], missing=missing[:5], per_rank=per_rank))
        if counts[0] != per_rank:
            raise Incorrect(_("{where}, every rank gets {count} samples, expected ceil(n / world_size) = "
                              "{per_rank}").format(where=where, count=counts[0], per_rank=per_rank))
        if missing:
            twice = sorted(i for i, c in Counter(sum(shards, [])).items() if c > 1)
            raise Incorrect(_("{where}, samples {missing} are on no rank and {twice} on more than one: did each "
                              "rank shuffle with its own seed? Ranks never exchange their indices, so any shuffle must "
                              "be the same seed on every rank (the same permutation), and each rank then takes its "
                              "part").format(where=where, missing=missing[:5], twice=twice[:5]))
        unordered = next((r for r, sh in enumerate(shards) if sum(b < a for a, b in zip(sh, sh[1:])) > 1), None)
        if unordered is not None:
            raise Incorrect(_("{where}, rank {rank} gets {shard}: not in order: likely mistake: the indices were "
                              "shuffled (with a seed shared by every rank, so they agree); this exercise asks for "
                              "the order without shuffling, as DistributedSampler(shuffle=False) gives: rank r takes "
                              "every world_size-th index from r").format(
                where=where, rank=unordered, shard=shards[unordered][:8]))
        if Counter(sum(shards, [])) != Counter(sum(expected, [])):
            extra = sorted((Counter(sum(shards, [])) - Counter(range(n))).elements())
            want = sorted((Counter(sum(expected, [])) - Counter(range(n))).elements())
            raise Incorrect(_("{where}, the padding repeats samples {extra}; pad by wrapping around, with the "
                              "first samples again ({want}), as DistributedSampler does").format(
                                  where=where, extra=extra, want=want))
        like_sampler = like_sampler and shards == expected
    if like_sampler:
        return _("every sample on a rank, the same count everywhere: the split DistributedSampler(shuffle=False) "
                 "makes")
    return _("every sample on a rank, the same count everywhere (in blocks; DistributedSampler interleaves: "
             "rank r takes every world_size-th index from r)")


_SHARD_HEAD = "def shard_indices(n, rank, world_size):\n"
_SHARD_SOLUTION = _SHARD_HEAD + (
    "    per_rank = math.ceil(n / world_size)\n"
    "    total = per_rank * world_size\n"
    "    indices = list(range(n))\n"
    "    while len(indices) < total:  # pad by wrapping around (more than once if n < world_size)\n"
    "        indices += indices[: total - len(indices)]\n"
    "    return indices[rank:total:world_size]\n")

register(Exercise(
    id="08.2", title=N_("Shard a dataset by rank"), answer="shard_indices",
    blank=_SHARD_HEAD + "    raise NotImplementedError  # your code here\n",
    solution=_SHARD_SOLUTION,
    setup="import math\n\nimport torch\n",
    checker=_check_shard_indices,
    hints=[N_("Every rank gets ceil(n / world_size) indices; the total, world_size times that, can exceed n."),
           N_("Make range(n) longer by appending its first samples again until it has `total` items, then take "
              "`indices[rank:total:world_size]`."),
           N_("With n < world_size (3 samples, 4 ranks) one wrap is not enough: keep appending until the list is "
              "long enough.")],
    mistakes=[
        Mistake(_SHARD_HEAD + "    return list(range(rank, n, world_size))\n", "a hang"),
        Mistake(_SHARD_HEAD + "    per = n // world_size\n    return list(range(rank * per, (rank + 1) * per))\n",
                "drops the remainder"),
        Mistake(_SHARD_HEAD + "    return list(range(n))\n", "every rank gets all"),
        Mistake(_SHARD_HEAD + "    g = torch.Generator().manual_seed(rank)\n"
                "    order = torch.randperm(n, generator=g).tolist()\n"
                "    total = math.ceil(n / world_size) * world_size\n"
                "    while len(order) < total:\n        order += order[: total - len(order)]\n"
                "    return order[rank:total:world_size]\n", "its own seed"),
        Mistake(_SHARD_HEAD + "    total = math.ceil(n / world_size) * world_size\n"
                "    indices = list(range(n)) + [n - 1] * (total - n)\n    return indices[rank::world_size]\n",
                "wrapping around"),
        Mistake(_SHARD_HEAD + "    order = torch.randperm(n).tolist()\n"
                "    total = math.ceil(n / world_size) * world_size\n"
                "    while len(order) < total:\n        order += order[: total - len(order)]\n"
                "    return order[rank:total:world_size]\n", "differs between two calls"),
        Mistake(_SHARD_HEAD + "    total = math.ceil(n / world_size) * world_size\n"
                "    indices = list(range(n))\n    indices += indices[: total - n]  # pad with the first samples\n"
                "    return indices[rank:total:world_size]\n", "wrapped around only once"),
        Mistake(_SHARD_HEAD + "    g = torch.Generator().manual_seed(0)  # the same seed on every rank\n"
                "    order = torch.randperm(n, generator=g).tolist()\n"
                "    total = math.ceil(n / world_size) * world_size\n"
                "    while len(order) < total:\n        order += order[: total - len(order)]\n"
                "    return order[rank:total:world_size]\n", "not in order"),
    ],
))


# --- 08.1 the learning rate of a configuration --------------------------------------------------------

def reference_lr(step, base_lr, base_batch, world_size, batch_per_process, accumulate, warmup_steps) -> float:
    target = base_lr * world_size * batch_per_process * accumulate / base_batch
    if step < warmup_steps:
        return base_lr + (target - base_lr) * step / warmup_steps
    return target


# (base_lr, base_batch, world_size, batch_per_process, accumulate, warmup_steps)
_LR_CASES = [(0.1, 256, 8, 32, 1, 100), (0.1, 256, 4, 32, 4, 50), (0.05, 64, 2, 32, 1, 10),
             (0.02, 128, 16, 64, 2, 0), (0.1, 256, 1, 64, 2, 20), (3e-4, 32, 8, 16, 2, 5)]


def _lr_with(target: float, step: int, base_lr: float, warmup: int) -> float:
    return base_lr + (target - base_lr) * step / warmup if step < warmup else target


def _as_rate(got) -> int | float | str:
    """scaled_lr's answer as an int or a float (a one-element tensor gives its item), or else what it is, described
    for feedback (a str)."""
    got = real_item(got)
    if as_float(got) is None:  # not a number, or an int no float can hold
        return describe(got)
    return float(got) if isinstance(got, float) else int(got)


def _check_scaled_lr(scaled_lr):
    if not observe(lambda: callable(scaled_lr)):
        raise Incorrect(_("scaled_lr should be a function, got {value}").format(
            value=observe(lambda: describe(scaled_lr))))
    for base_lr, base_batch, world, batch, acc, warmup in _LR_CASES:
        config = _("base_lr={base_lr:g} for batch {base_batch}, {world} processes x batch {batch} x accumulate "
                   "{acc}, warmup_steps={warmup}").format(base_lr=base_lr, base_batch=base_batch, world=world,
                                                          batch=batch, acc=acc, warmup=warmup)
        glob = world * batch * acc
        target = base_lr * glob / base_batch
        # plausible wrong targets, each reached after the right warm-up
        wrong_targets = [
            (base_lr * world * batch / base_batch,
             _("accumulate is left out of the global batch; it is {world} x {batch} x {acc} = {glob} samples per "
               "optimizer step").format(world=world, batch=batch, acc=acc, glob=glob)),
            (base_lr * batch * acc / base_batch,
             _("world_size is left out: each optimizer step averages the gradients of all {world} processes, so the "
               "global batch is {glob}").format(world=world, glob=glob)),
            (base_lr * world,
             _("the rate is multiplied by the number of processes; the linear rule multiplies by global batch / base "
               "batch = {glob} / {base_batch}").format(glob=glob, base_batch=base_batch)),
            (base_lr * math.sqrt(glob / base_batch),
             _("that is square-root scaling, another heuristic; this exercise asks for the linear scaling rule: "
               "base_lr x global batch / base batch")),
        ]
        for step in sorted({0, 1, warmup // 2, max(warmup - 1, 0), warmup, warmup + 7}):
            got = observe(lambda: _as_rate(call(scaled_lr, step, base_lr, base_batch, world, batch, acc, warmup,
                                                name="scaled_lr")))
            if isinstance(got, str):
                raise Incorrect(_("scaled_lr returned {value}; return the learning rate as a float").format(
                    value=got))
            want = reference_lr(step, base_lr, base_batch, world, batch, acc, warmup)
            if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15):
                continue
            at = _("at step {step} ({config}) you return {got:g}, expected {want:g}").format(
                step=step, config=config, got=got, want=want)
            for wrong, why in wrong_targets:
                if math.isclose(got, _lr_with(wrong, step, base_lr, warmup), rel_tol=1e-9):
                    raise Incorrect(_("{at}: likely mistake: {why}").format(at=at, why=why))
            if step < warmup and math.isclose(got, target, rel_tol=1e-9):
                raise Incorrect(_("{at}: likely mistake: no warm-up; during the first {warmup} steps the rate "
                                  "should climb linearly from base_lr to the scaled rate").format(at=at, warmup=warmup))
            ratio = glob // base_batch
            if glob % base_batch and math.isclose(got, _lr_with(base_lr * ratio, step, base_lr, warmup),
                                                  rel_tol=1e-9, abs_tol=1e-15):
                raise Incorrect(_("{at}: likely mistake: integer division, global batch // base batch = {glob} // "
                                  "{base_batch} = {ratio}; the ratio is {exact:g}: divide with /").format(
                    at=at, glob=glob, base_batch=base_batch, ratio=ratio, exact=glob / base_batch))
            if 0 < warmup and step < warmup and math.isclose(got, _lr_with(target, step + 1, base_lr, warmup),
                                                             rel_tol=1e-9):
                raise Incorrect(_("{at}: likely mistake: the warm-up is one step ahead, (step + 1) / warmup_steps; "
                                  "at step 0 the rate is base_lr itself, and it reaches the scaled rate at step "
                                  "warmup_steps").format(at=at))
            if step < warmup and math.isclose(got, target * step / warmup, rel_tol=1e-9, abs_tol=1e-15):
                raise Incorrect(_("{at}: likely mistake: the warm-up starts at 0; Goyal et al. start it at base_lr "
                                  "(the rate that works for the base batch) and climb linearly to the scaled "
                                  "rate").format(at=at))
            raise Incorrect(_("{at} (global batch {glob}: the rate climbs linearly from base_lr at step 0 to "
                              "{target:g} at step {warmup}, and stays there)").format(
                                  at=at, glob=glob, target=target, warmup=warmup))
    return _("global batch = processes x batch x accumulate; the linear rule, reached after a linear warm-up")


_LR_HEAD = "def scaled_lr(step, base_lr, base_batch, world_size, batch_per_process, accumulate, warmup_steps):\n"
_LR_SOLUTION = _LR_HEAD + (
    "    global_batch = world_size * batch_per_process * accumulate\n"
    "    target = base_lr * global_batch / base_batch  # the linear scaling rule\n"
    "    if step < warmup_steps:  # climb linearly from base_lr to the target\n"
    "        return base_lr + (target - base_lr) * step / warmup_steps\n"
    "    return target\n")
_LR_NO_WARMUP = ("    if step < warmup_steps:\n"
                 "        return base_lr + (target - base_lr) * step / warmup_steps\n"
                 "    return target\n")

register(Exercise(
    id="08.1", title=N_("The learning rate of a configuration"), answer="scaled_lr",
    blank=_LR_HEAD + "    raise NotImplementedError  # your code here\n",
    solution=_LR_SOLUTION,
    setup="import math\n",
    checker=_check_scaled_lr,
    hints=[N_("The global batch of one optimizer step is world_size x batch_per_process x accumulate."),
           N_("The linear rule: target = base_lr x global_batch / base_batch. Before step warmup_steps, go linearly "
              "from base_lr (step 0) to target (step warmup_steps).")],
    mistakes=[
        Mistake(_LR_HEAD + "    target = base_lr * world_size * batch_per_process / base_batch\n" + _LR_NO_WARMUP,
                "accumulate is left out"),
        Mistake(_LR_HEAD + "    target = base_lr * batch_per_process * accumulate / base_batch\n" + _LR_NO_WARMUP,
                "world_size is left out"),
        Mistake(_LR_HEAD + "    target = base_lr * world_size\n" + _LR_NO_WARMUP, "multiplied by the number of processes"),
        Mistake(_LR_HEAD + "    return base_lr * world_size * batch_per_process * accumulate / base_batch\n",
                "no warm-up"),
        Mistake(_LR_HEAD + "    target = base_lr * world_size * batch_per_process * accumulate / base_batch\n"
                "    if step < warmup_steps:\n        return target * step / warmup_steps\n    return target\n",
                "starts at 0"),
        Mistake(_LR_HEAD + "    target = base_lr * math.sqrt(world_size * batch_per_process * accumulate / base_batch)\n"
                + _LR_NO_WARMUP, "square-root scaling"),
        Mistake(_LR_HEAD + "    target = base_lr * world_size * batch_per_process * accumulate / base_batch\n"
                "    if step < warmup_steps:\n"
                "        return base_lr + (target - base_lr) * (step + 1) / warmup_steps  # steps count from 1\n"
                "    return target\n", "one step ahead"),
        Mistake(_LR_HEAD + "    k = world_size * batch_per_process * accumulate // base_batch  # times bigger\n"
                "    target = base_lr * k\n" + _LR_NO_WARMUP, "integer division"),
    ],
))


# --- 08.4 which snippets make the replicas drift apart ------------------------------------------------

# Verified on 2 real processes by course_utils.examples.ddp_demos (mode "diverge"), in tests/test_nb08_demos.py.
DIVERGING = frozenset("ACG")
_WHY = {
    "A": N_("A steps the scheduler on rank 0 only: after the first epoch the ranks train with different learning "
            "rates, so the same averaged gradient moves their weights by different amounts"),
    "B": N_("B is harmless: DDP broadcasts rank 0's parameters and buffers when it is constructed, so the per-rank seed "
            "before building the model is overwritten"),
    "C": N_("C diverges: without DDP nothing broadcasts the initial weights, and identical averaged updates keep the "
            "different starting points apart"),
    "D": N_("D does not make the replicas diverge: without set_epoch the sampler draws the same order in every epoch, "
            "alike on every rank, so the weights stay equal; it is a different bug: the data is never reshuffled"),
    "E": N_("E is harmless: clip_grad_norm_ after backward clips the averaged gradients, the same on every rank"),
    "F": N_("F is harmless: different dropout masks on each rank only change the local gradients, which DDP averages "
            "before every rank applies the same update"),
    "G": N_("G diverges: rank 0 clips its gradients and rank 1 does not, so their updates differ"),
}


def _answer_seen(answer) -> tuple:
    """The answer to 08.4 as plain data: ("string", its text), ("items", [each item, a str as its text]) for a set,
    frozenset, list or tuple, or ("other", its description)."""
    if isinstance(answer, str):
        return "string", str.__str__(answer)
    if not isinstance(answer, (set, frozenset, list, tuple)):
        return "other", describe(answer)
    return "items", [str.__str__(item) if isinstance(item, str) else item for item in answer]


def _check_diverging(answer):
    kind, seen = observe(lambda: _answer_seen(answer))
    if kind == "string":
        raise Incorrect(_("expected a set of letters such as {example}, got the string {answer!r}").format(
            example='{"A", "B"}', answer=seen))
    if kind != "items":
        raise Incorrect(_("expected a set of letters such as {example}, got {value}").format(
            example='{"A", "B"}', value=seen))
    letters = set()
    for item in seen:
        if not isinstance(item, str) or item.strip().upper() not in _WHY:
            raise Incorrect(_("{item!r} is not one of the snippets A to G").format(item=item))
        letters.add(item.strip().upper())
    wrong = sorted(letters - DIVERGING)
    if wrong:
        raise Incorrect(_("; ").join(_(_WHY[w]) for w in wrong))
    missing = sorted(DIVERGING - letters)
    if missing:
        why = _("; ").join(_(_WHY[m]) for m in missing)
        if len(missing) == 1:
            raise Incorrect(_("one is missing: {why}").format(why=why))
        raise Incorrect(_("{count} are missing: {why}").format(count=len(missing), why=why))
    return _("A, C and G: anything that makes one rank's update differ (a rate, a clip, an optimizer step) or its "
             "starting point differ without DDP's broadcast; 2 real processes drift apart on exactly these")


register(Exercise(
    id="08.4", title=N_("Which snippets make the replicas drift apart"), answer="diverging",
    blank="diverging = ...  # a set of letters, e.g. {\"A\", \"B\"}",
    solution="diverging = {\"A\", \"C\", \"G\"}",
    checker=_check_diverging,
    hints=[N_("The replicas stay equal as long as every rank starts from the same weights and applies the same "
              "update. DDP makes the gradients equal (averaged) after backward; what happens after that is up to each "
              "rank."),
           N_("A per-rank seed matters only if nothing copies rank 0's weights to the others: DDP's constructor "
              "does.")],
    mistakes=[
        Mistake("diverging = {\"A\", \"G\"}", "C diverges"),
        Mistake("diverging = {\"A\", \"B\", \"C\", \"G\"}", "B is harmless"),
        Mistake("diverging = {\"A\", \"C\", \"D\", \"G\"}", "a different bug"),
        Mistake("diverging = {\"A\", \"C\", \"F\", \"G\"}", "F is harmless"),
        Mistake("diverging = {\"A\", \"C\", \"E\", \"G\"}", "E is harmless"),
        Mistake("diverging = {\"C\", \"G\"}", "A steps the scheduler on rank 0 only"),
        Mistake("diverging = \"ACG\"", "got the string"),
        Mistake("diverging = {\"A\"}", "2 are missing"),
        Mistake("diverging = {\"A\", \"C\"}", "G diverges"),
    ],
))


# --- 08.3 accumulation without an all-reduce per micro-batch ------------------------------------------

@contextlib.contextmanager
def one_process_group():
    """A gloo process group of one process, in this process (a FileStore in a temporary folder), destroyed on
    leaving. An existing group of one process is reused and left in place."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise Incorrect(_("this check runs on a process group of one process; run it outside a distributed "
                              "launch"))
        yield
        return
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


_SIZES = (5, 3, 4)  # micro-batches of unequal size: weighting by 1/k would be wrong


def _micro_batches(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in _SIZES]


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _after_step(weights_of) -> list[torch.Tensor]:
    """The weights after one SGD step (lr 0.1) from _net() with the gradient `weights_of(model)` builds."""
    model = _net()
    weights_of(model)
    with torch.no_grad():
        return [p - 0.1 * p.grad for p in model.parameters()]


def _oracles(micro) -> dict[str, list[torch.Tensor]]:
    loss_fn = nn.CrossEntropyLoss()
    x = torch.cat([b[0] for b in micro])
    y = torch.cat([b[1] for b in micro])
    total = len(y)

    def full(m):
        loss_fn(m(x), y).backward()

    def unweighted(m):
        for xb, yb in micro:
            loss_fn(m(xb), yb).backward()

    def one_over_k(m):
        for xb, yb in micro:
            (loss_fn(m(xb), yb) / len(micro)).backward()

    def last_only(m):
        xb, yb = micro[-1]
        (loss_fn(m(xb), yb) * len(yb) / total).backward()

    def stale(m):  # the gradients that were already there (7.0 everywhere) are kept
        for p in m.parameters():
            p.grad = torch.full_like(p, 7.0)
        full(m)

    def first_size(m):  # total taken as k x the first micro-batch's size
        (loss_fn(m(x), y) * total / (len(micro) * len(micro[0][1]))).backward()

    def halved(m):  # divided by a world size of 2
        (loss_fn(m(x), y) / 2).backward()

    return {name: _after_step(fn) for name, fn in
            [("full", full), ("unweighted", unweighted), ("one_over_k", one_over_k), ("last_only", last_only),
             ("stale", stale), ("first_size", first_size), ("halved", halved)]}


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in zip(a, b))


def _check_accumulate_step(accumulate_step):
    if not observe(lambda: callable(accumulate_step)):
        raise Incorrect(_("accumulate_step should be a function, got {value}").format(
            value=observe(lambda: describe(accumulate_step))))
    micro = _micro_batches()
    oracles = _oracles(micro)
    weights, steps, allreduces = observe(lambda: _run_accumulate_step(accumulate_step, micro))
    k = len(micro)
    if len(steps) != 1:
        raise Incorrect(_("optimizer.step() ran {count} times for {k} micro-batches: likely mistake: {why}").format(
            count=len(steps), k=k,
            why=_("a step per micro-batch; accumulate the gradients of all of them, then step once")
            if len(steps) > 1 else _("no optimizer step at the end")))
    if not allreduces:
        raise Incorrect(_("no gradient all-reduce ran: the last micro-batch's forward or backward ran inside "
                          "no_sync too (DDP decides at the forward whether the backward communicates), or not "
                          "through ddp_model, so the gradients were never averaged over ranks. Run the last "
                          "micro-batch's forward and backward through ddp_model outside no_sync()"))
    if len(allreduces) >= k:
        raise Incorrect(_("the gradients were all-reduced after every micro-batch ({count} bucket all-reduces "
                          "for {k} micro-batches): likely mistake: no no_sync(), or only the backward inside it (DDP "
                          "decides at the forward). Run the forward and backward of all but the last micro-batch "
                          "inside `with ddp_model.no_sync():`, so only the last backward communicates").format(
                              count=len(allreduces), k=k))
    if _close(weights, oracles["full"]):
        # the check runs on one process; told there are two ranks, the answer must make the same update (DDP
        # averages: nothing in the step depends on the number of ranks)
        weights, _steps, _allreduces = observe(lambda: _run_accumulate_step(accumulate_step, micro,
                                                                             told_world_size=2))
        if _close(weights, oracles["halved"]):
            raise Incorrect(_("this check runs on one process; when torch.distributed.get_world_size() told your "
                              "step there were 2 ranks, its update came out half as large: likely mistake: the "
                              "gradients (or the losses) were divided by the world size, but DDP's all-reduce "
                              "already averages them over the ranks (the sum divided by world_size), so on N ranks "
                              "this update would be N times too small"))
        if not _close(weights, oracles["full"]):
            raise Incorrect(_("this check runs on one process; when torch.distributed.get_world_size() told your "
                              "step there were 2 ranks, its update changed: it must not depend on the number of "
                              "ranks, since DDP's all-reduce already averages the gradients"))
        return _("{count} all-reduce for {k} micro-batches, and the update of one batch of {total}: no_sync for "
                 "all but the last, each loss weighted by its share of the samples").format(
                     count=len(allreduces), k=k, total=sum(_SIZES))
    for name, feedback in [
            ("stale", _("the gradients left from before were kept: likely mistake: no optimizer.zero_grad() "
                        "before the first backward")),
            ("last_only", _("the update is that of the last micro-batch alone: likely mistake: zero_grad() inside "
                            "the loop, which throws away the gradients accumulated so far")),
            ("unweighted", _("the update is the sum of the micro-batches' mean-loss gradients: likely mistake: the "
                             "losses are not weighted by share; weight each by len(targets) / total samples")),
            ("one_over_k", _("each micro-batch's mean loss is weighted by 1/k: with micro-batches of different sizes "
                             "({sizes}) weight each by len(targets) / total samples").format(
                                 sizes=", ".join(map(str, _SIZES)))),
            ("first_size", _("the update is {ratio:.2f} times that of one step on the {total} samples together: "
                             "likely mistake: the total was taken as k x the first micro-batch's size ({k} x {first} "
                             "= {counted}), but the micro-batches hold {sizes} samples: sum len(targets) over all "
                             "of them").format(ratio=sum(_SIZES) / (k * _SIZES[0]), total=sum(_SIZES), k=k,
                                               first=_SIZES[0], counted=k * _SIZES[0],
                                               sizes=", ".join(map(str, _SIZES))))]:
        if _close(weights, oracles[name]):
            raise Incorrect(feedback)
    raise Incorrect(_("the weights after your step differ from one step on the {total} samples together "
                      "(largest difference {difference:.2e})").format(
                          total=sum(_SIZES),
                          difference=max((p - q).abs().max().item() for p, q in zip(weights, oracles["full"]))))


def _run_accumulate_step(accumulate_step, micro, told_world_size: int | None = None
                         ) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """The weights after the learner's step on a DDP model (a process group of one process, stale gradients 7.0
    left in p.grad), the optimizer steps it made and the sizes of DDP's bucket all-reduces. `told_world_size`:
    what torch.distributed.get_world_size() answers the learner's code during the call."""
    from torch.nn.parallel import DistributedDataParallel

    with one_process_group():
        model = _net()
        ddp = DistributedDataParallel(model)
        allreduces = []

        def counting_allreduce(state, bucket):  # DDP's all-reduce of one bucket of gradients, counted
            import torch.distributed as dist
            allreduces.append(bucket.buffer().numel())
            work = dist.all_reduce(bucket.buffer(), async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])

        ddp.register_comm_hook(None, counting_allreduce)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = []
        real_step = optimizer.step
        optimizer.step = lambda *a, **k: (steps.append(1), real_step(*a, **k))[1]
        for p in model.parameters():  # gradients left over from an earlier step: zero them first
            p.grad = torch.full_like(p, 7.0)
        told = (mock.patch("torch.distributed.get_world_size", lambda *args, **kwargs: told_world_size)
                if told_world_size is not None else contextlib.nullcontext())
        try:
            with told:
                call(accumulate_step, ddp, optimizer, nn.CrossEntropyLoss(),
                     [(x.clone(), y.clone()) for x, y in micro], name="accumulate_step", check_mutation=False)
            weights = [p.detach().clone() for p in model.parameters()]
        finally:
            del ddp, counting_allreduce
    return weights, steps, allreduces


_ACC_HEAD = "def accumulate_step(ddp_model, optimizer, loss_fn, micro_batches):\n"
_ACC_SOLUTION = _ACC_HEAD + (
    "    optimizer.zero_grad()\n"
    "    total = sum(len(y) for _, y in micro_batches)\n"
    "    *first, last = micro_batches\n"
    "    with ddp_model.no_sync():  # gradients accumulate locally: no all-reduce\n"
    "        for x, y in first:\n"
    "            (loss_fn(ddp_model(x), y) * len(y) / total).backward()\n"
    "    x, y = last\n"
    "    (loss_fn(ddp_model(x), y) * len(y) / total).backward()  # this backward all-reduces the sum\n"
    "    optimizer.step()\n")

register(Exercise(
    id="08.3", title=N_("Accumulate without an all-reduce per micro-batch"), answer="accumulate_step",
    blank=_ACC_HEAD + "    raise NotImplementedError  # your code here\n",
    solution=_ACC_SOLUTION,
    setup="import torch\n",
    checker=_check_accumulate_step,
    timeout=20,
    inside=N_("optimizer steps and gradient all-reduces counted while the answer ran"),
    hints=[N_("One optimizer step for the whole list: zero_grad first, a backward per micro-batch, step at the "
              "end."),
           N_("`with ddp_model.no_sync():` around the forward and backward of every micro-batch except the last; the "
              "last backward, outside it, all-reduces the accumulated gradients."),
           N_("The loss_fn returns a mean over its micro-batch: multiply each by len(y) / total so the sum of the "
              "gradients is the mean over all samples.")],
    mistakes=[
        Mistake(_ACC_HEAD + "    optimizer.zero_grad()\n    total = sum(len(y) for _, y in micro_batches)\n"
                "    for x, y in micro_batches:\n        (loss_fn(ddp_model(x), y) * len(y) / total).backward()\n"
                "    optimizer.step()\n", "no no_sync()"),
        Mistake(_ACC_HEAD + "    optimizer.zero_grad()\n    total = sum(len(y) for _, y in micro_batches)\n"
                "    with ddp_model.no_sync():\n        for x, y in micro_batches:\n"
                "            (loss_fn(ddp_model(x), y) * len(y) / total).backward()\n    optimizer.step()\n",
                "never averaged"),
        Mistake(_ACC_SOLUTION.replace(" * len(y) / total", ""), "not weighted by share"),
        Mistake(_ACC_SOLUTION.replace(" * len(y) / total", " / len(micro_batches)"), "weighted by 1/k"),
        Mistake(_ACC_SOLUTION.replace("    optimizer.zero_grad()\n", ""), "no optimizer.zero_grad()"),
        Mistake(_ACC_HEAD + "    total = sum(len(y) for _, y in micro_batches)\n    *first, last = micro_batches\n"
                "    with ddp_model.no_sync():\n        for x, y in first:\n            optimizer.zero_grad()\n"
                "            (loss_fn(ddp_model(x), y) * len(y) / total).backward()\n    x, y = last\n"
                "    optimizer.zero_grad()\n    (loss_fn(ddp_model(x), y) * len(y) / total).backward()\n"
                "    optimizer.step()\n", "zero_grad() inside the loop"),
        Mistake(_ACC_HEAD + "    optimizer.zero_grad()\n    total = sum(len(y) for _, y in micro_batches)\n"
                "    *first, last = micro_batches\n    with ddp_model.no_sync():\n        for x, y in first:\n"
                "            (loss_fn(ddp_model(x), y) * len(y) / total).backward()\n            optimizer.step()\n"
                "    x, y = last\n    (loss_fn(ddp_model(x), y) * len(y) / total).backward()\n    optimizer.step()\n",
                "a step per micro-batch"),
        Mistake(_ACC_SOLUTION.replace("    optimizer.step()\n",
                                      "    for p in ddp_model.parameters():  # DDP sums the ranks' gradients\n"
                                      "        p.grad /= torch.distributed.get_world_size()\n"
                                      "    optimizer.step()\n"), "divided by the world size"),
        Mistake(_ACC_SOLUTION.replace("    total = sum(len(y) for _, y in micro_batches)\n",
                                      "    total = len(micro_batches) * len(micro_batches[0][1])\n"),
                "the total was taken as k x the first micro-batch's size"),
        Mistake(_ACC_HEAD + "    optimizer.zero_grad()\n    total = sum(len(y) for _, y in micro_batches)\n"
                "    with ddp_model.no_sync():  # all the forwards first\n"
                "        losses = [loss_fn(ddp_model(x), y) * len(y) / total for x, y in micro_batches]\n"
                "        for loss in losses[:-1]:\n            loss.backward()\n"
                "    losses[-1].backward()  # outside no_sync: this one all-reduces\n    optimizer.step()\n",
                "forward or backward ran inside no_sync"),
    ],
))


# --- 08.5 how often to checkpoint --------------------------------------------------------------------

_INTERVAL_CASES = [  # (step_s, save_s, mtbf_s)
    (0.25, 2.0, 3 * 3600.0),   # a small model, a crash every 3 hours
    (5.0, 120.0, 11160.0),     # a large job: a failure every 3.1 h (Llama 3's rate), a 2-minute save
    (1.5, 60.0, 4 * 3600.0),
    (1, 30, 86400),            # whole numbers in: a failure a day
    (2.0, 0.01, 60.0),         # sqrt(2 C M) shorter than a step: the formula gives 0.55 steps
    (3.0, 0.5, 5.0),           # 0.75 steps by the formula
    (1.0, 0.01, 10.0),         # 0.45 steps: round() alone gives 0
    (1.0, 0.0, 3600.0),        # a save that costs nothing: 0 steps by the formula
]
_INTERVAL_TOLERANCE = 1.02  # at most 2 % more time lost than the best whole number of steps


def _random_interval_case() -> tuple[float, float, float]:
    """A job drawn afresh at every check (not from the checker's own generator): no table of answers passes."""
    rng = fresh_random()
    return (round(rng.uniform(0.05, 4.0), 3), round(rng.uniform(1.0, 90.0), 2), round(rng.uniform(1.0, 48.0) * 3600))


def _wrong_interval(k: int, step_s: float, save_s: float, mtbf_s: float) -> str:
    """The likely mistake behind an interval that loses too much time, if it matches one; else the formula."""
    formula = math.sqrt(2 * save_s * mtbf_s) / step_s
    if formula < 1:
        return _("Here sqrt(2 * save_s * mtbf_s) is shorter than one step (the formula gives {formula:.2f} "
                 "steps): save after every step, 1").format(formula=formula)
    if k == 1 and formula >= 2:
        return _("Young's approximation: sqrt(2 * save_s * mtbf_s) seconds of training between saves, divided by "
                 "step_s: {formula:.0f} steps here. If the 1 comes from min(1, ...): min caps the interval at one "
                 "step, while 'at least 1' is max(1, ...)").format(formula=formula)
    candidates = [
        (math.sqrt(2 * save_s * mtbf_s), _("that is the interval in seconds, sqrt(2 * save_s * mtbf_s); divide it by "
                                           "step_s for a number of steps")),
        (math.sqrt(save_s * mtbf_s) / step_s, _("likely sqrt(save_s * mtbf_s) without the 2: Young's minimum is at "
                                                "sqrt(2 * save_s * mtbf_s)")),
        (2 * save_s * mtbf_s / step_s, _("likely 2 * save_s * mtbf_s without the square root")),
    ]
    for value, why in candidates:
        if k > 10 ** 15:  # no formula here gives that many; and a float would overflow
            break
        if abs(value - formula) > max(1.0, 0.02 * formula) and abs(k - value) <= max(1.0, 0.01 * value):
            return why
    return _("Young's approximation: sqrt(2 * save_s * mtbf_s) seconds of training between saves, divided by "
             "step_s for steps")


def _whole_steps(value) -> int | str:
    """The answer as an int (from a Python or NumPy int, or a 0-d integer tensor or array), or else what it is,
    described for feedback (a str)."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0 and (
            value.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
            if isinstance(value, torch.Tensor) else np.issubdtype(value.dtype, np.integer)):
        try:
            return int(value)
        except Exception:  # a tensor without data (the meta device): no value to read
            pass
    elif not isinstance(value, bool) and isinstance(value, numbers.Integral):
        return int(value)
    return describe(value)


def _require_whole(seen: int | str, label: str) -> int:
    """What `_whole_steps` saw, an int; or feedback."""
    if isinstance(seen, str):
        raise Incorrect(_("{label} returned {value}: return a whole number of steps, an int (round() gives "
                          "one)").format(label=label, value=seen))
    return seen


def _check_steps_between_checkpoints(fn):
    if not observe(lambda: callable(fn)):
        raise Incorrect(_("steps_between_checkpoints should be a function, got {value}").format(
            value=observe(lambda: describe(fn))))
    answers = []
    # the job no table holds is drawn where the answer runs; the judgement reads the same one from the record
    for step_s, save_s, mtbf_s in [*_INTERVAL_CASES, _random_interval_case()]:
        label = f"steps_between_checkpoints({step_s}, {save_s}, {mtbf_s})"
        k = _require_whole(observe(lambda: _whole_steps(call(fn, step_s, save_s, mtbf_s,
                                                             name="steps_between_checkpoints"))), label)
        again = _require_whole(observe(lambda: _whole_steps(call(fn, step_s, save_s, mtbf_s,
                                                                 name="steps_between_checkpoints"))), label)
        if again != k:
            raise Incorrect(_("{label} returned {k}, then {again}: the same job should get the same interval every "
                              "time").format(label=label, k=k, again=again))
        formula = math.sqrt(2 * save_s * mtbf_s) / step_s
        if k < 1:
            if k == 0 and formula < 1:
                raise Incorrect(_("{label} returned 0: here the formula gives {formula:.2f} steps "
                                  "(sqrt(2 * save_s * mtbf_s) is shorter than one step), which rounds to 0 and "
                                  "would mean never saving. Save at least every step: max(1, ...)").format(
                                      label=label, formula=formula))
            raise Incorrect(_("{label} returned {k}: the number of steps between saves is at least 1").format(
                label=label, k=k))
        if k > 50 * mtbf_s / step_s:  # lost_fraction would overflow; and a failure comes long before any save
            digits = str(k)
            shown = digits if len(digits) <= 15 else f"{digits[:3]}... ({len(digits)} digits)"
            raise Incorrect(_("{label} returned {k}: that many steps between saves are more than 50 times the mean "
                              "time between failures ({mtbf} s) of training, so a failure nearly always comes before "
                              "the save. {why}").format(label=label, k=shown, mtbf=mtbf_s,
                                                        why=_wrong_interval(k, step_s, save_s, mtbf_s)))
        best = failures.best_interval(step_s, save_s, mtbf_s)
        mine = failures.lost_fraction(k, step_s, save_s, mtbf_s)
        least = failures.lost_fraction(best, step_s, save_s, mtbf_s)
        if mine > _INTERVAL_TOLERANCE * least:
            raise Incorrect(_("{label} returned {k}: a save every {k} step(s) loses {mine:.2%} of the training time to "
                              "saves and redone work; every {best} steps loses {least:.2%}. {why}").format(
                                  label=label, k=k, mine=mine, best=best, least=least,
                                  why=_wrong_interval(k, step_s, save_s, mtbf_s)))
        answers.append(k)
    step_s, save_s, mtbf_s = _INTERVAL_CASES[0]
    k = answers[0]
    work = int(20 * mtbf_s / step_s)  # 60 hours of training: some 20 failures a job
    simulated = failures.simulated_lost_fraction(k, step_s, save_s, mtbf_s, work, runs=100, seed=0)
    return _("every interval within 2% of the least time lost. A check by simulation: 100 jobs of 60 hours with "
             "failures at random, a save every {k} steps, lost {simulated:.2%} of the time (the formula: "
             "{exact:.2%})").format(k=k, simulated=simulated,
                                    exact=failures.lost_fraction(k, step_s, save_s, mtbf_s, work_steps=work))


_INTERVAL_HEAD = "def steps_between_checkpoints(step_s, save_s, mtbf_s):\n"

register(Exercise(
    id="08.5", title=N_("How often to checkpoint"), answer="steps_between_checkpoints",
    blank=_INTERVAL_HEAD + "    raise NotImplementedError  # your code here\n",
    solution=_INTERVAL_HEAD + (
        "    tau = math.sqrt(2 * save_s * mtbf_s)  # seconds of training between saves (Young)\n"
        "    return max(1, round(tau / step_s))  # whole steps, at least one\n"),
    setup="import math\nimport sys\n\ncalls = []\n",
    checker=_check_steps_between_checkpoints,
    hints=[N_("Saving every tau seconds of training costs save_s per tau; a failure loses on average half an "
              "interval, tau / 2, once per mtbf_s. The sum save_s / tau + tau / (2 * mtbf_s) is least at tau = "
              "sqrt(2 * save_s * mtbf_s)."),
           N_("tau is in seconds; a step takes step_s seconds: tau / step_s steps, rounded to a whole number."),
           N_("When sqrt(2 * save_s * mtbf_s) is shorter than one step (a save that costs almost nothing), the "
              "formula gives less than one step: save after every step (at least 1).")],
    mistakes=[
        Mistake(_INTERVAL_HEAD + "    return round(math.sqrt(save_s * mtbf_s) / step_s)\n", "without the 2"),
        Mistake(_INTERVAL_HEAD + "    return max(1, round(math.sqrt(2 * save_s * mtbf_s)))\n",
                "divide it by step_s"),
        Mistake(_INTERVAL_HEAD + "    return int(math.sqrt(2 * save_s * mtbf_s) / step_s)\n", "never saving"),
        Mistake(_INTERVAL_HEAD + "    return math.sqrt(2 * save_s * mtbf_s) / step_s\n", "a whole number of steps"),
        Mistake(_INTERVAL_HEAD + "    return max(1, round(2 * save_s * mtbf_s / step_s))\n",
                "without the square root"),
        Mistake(_INTERVAL_HEAD + "    return max(1, round(math.sqrt(2 * save_s / mtbf_s) / step_s))\n",
                "Young's approximation"),
        Mistake(_INTERVAL_HEAD + "    hours = mtbf_s / 3600\n    return max(1, round(math.sqrt(2 * save_s * hours) / "
                "step_s))\n", "Young's approximation"),
        Mistake(_INTERVAL_HEAD + "    return max(1, round(mtbf_s / step_s / 2))\n", "Young's approximation"),
        Mistake(_INTERVAL_HEAD + "    return round(math.sqrt(2 * save_s * mtbf_s) / step_s)\n", "rounds to 0"),
        Mistake(_INTERVAL_HEAD + "    return round((math.sqrt(2 * save_s * mtbf_s) - save_s) / step_s)\n",
                "rounds to 0"),
        Mistake(_INTERVAL_HEAD + "    return max(1, round(math.sqrt(2 * save_s * mtbf_s) / step_s)) + 1\n",
                "save after every step"),
        Mistake(_INTERVAL_HEAD + "    return {(0.25, 2.0, 10800.0): 831, (5.0, 120.0, 11160.0): 327, (1.5, 60.0, 14400.0): "
                "876,\n            (1, 30, 86400): 2277, (2.0, 0.01, 60.0): 1, (3.0, 0.5, 5.0): 1, (1.0, 0.01, 10.0): 1,\n"
                "            (1.0, 0.0, 3600.0): 1}.get((step_s, save_s, mtbf_s), 100)\n", "Young's approximation"),
        Mistake(_INTERVAL_HEAD + "    return sys.maxsize  # never save\n", "more than 50 times"),
        Mistake(_INTERVAL_HEAD + "    return min(1, round(math.sqrt(2 * save_s * mtbf_s) / step_s))  # at least 1\n",
                "min caps the interval at one step"),
        Mistake(_INTERVAL_HEAD + "    return max(1, math.sqrt(2 * save_s * mtbf_s) // step_s)  # whole steps\n",
                "return a whole number of steps"),
        Mistake(_INTERVAL_HEAD + "    return max(1, round((2 * save_s * mtbf_s) ** 2 / step_s))\n", "more than 50 times"),
        Mistake(_INTERVAL_HEAD + "    calls.append(1)\n    return max(1, round(math.sqrt(2 * save_s * mtbf_s) / step_s "
                "* (1 + len(calls) % 2 / 10)))\n", "the same job should get the same interval"),
    ],
))
