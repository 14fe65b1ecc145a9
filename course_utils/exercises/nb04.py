"""Exercises of notebook 04, "How fast is GPU training, really?".

04.1 time an asynchronous device correctly (warm-up, synchronize, median), checked against a simulated
GPU whose work only happens when you synchronize; 04.2 an epoch's mean loss with one CPU-GPU sync,
counted on every host read of the loss tensors; 04.3 a fair speed-up on a simulated machine whose load changes
(alternation, warm-up, median of paired ratios); 04.4 host reads per step counted in a torch.profiler profile,
checked on profiles of loops with known reads per step; 04.5 the fastest thread count, measured (set, warm up, median,
put back also on errors), checked on steps whose speed depends on the thread count and on a real step beside a busy
core.
"""
from __future__ import annotations

import math
import statistics
import time

import torch

from ._sync import HostReads, on_device
from ..i18n import N_, _
from .core import AnswerTimeout, Exercise, Incorrect, Mistake, as_float, call, describe, real_item, register
from .probe import Opaque, hold, observe, short

_READ_OP = "aten::_local_scalar_dense"  # every scalar read: .item(), float(), int(), bool(), formatting
_ITEM_OP = "aten::item"                 # the op those call, which calls _READ_OP: one read, two nested events


def _as_number(value, label: str, what: str) -> float:
    number = as_float(real_item(value))
    if number is None or not math.isfinite(number):
        raise Incorrect(_("{label} should return {what}, got {value}").format(
            label=label, what=what, value=describe(value)))
    return number


# --- a simulated clock (04.1, 04.5) -----------------------------------------------------------

class _Clock:
    """The wall clock the learner's code reads during a simulation (04.1, 04.5): it moves only while simulated work
    runs (a sync that waits, a step), by that work's duration, so timings are exact on any machine, however busy. Its
    CPU clocks (process_time) never move: waiting uses no CPU. Anything else is the real `time` module's."""

    def __init__(self):
        import types

        self.now = 1000.0
        real = time
        fake = types.ModuleType("time")
        fake.__dict__.update({k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
        fake.perf_counter = fake.monotonic = fake.time = lambda: self.now
        fake.perf_counter_ns = fake.monotonic_ns = fake.time_ns = lambda: int(self.now * 1e9)
        fake.process_time = fake.thread_time = lambda: 0.0
        fake.process_time_ns = fake.thread_time_ns = lambda: 0
        self.module = fake

    def installed_in(self, fn):
        """Swap the clock into `fn`'s globals (the module `time` and names imported from it) for a with block."""
        import contextlib

        namespace = getattr(fn, "__globals__", None)
        if namespace is None:  # a callable object: its __call__'s module
            namespace = getattr(getattr(type(fn), "__call__", None), "__globals__", {})
        real = {getattr(time, name): name for name in ("perf_counter", "monotonic", "time", "perf_counter_ns",
                                                        "monotonic_ns", "time_ns", "process_time", "thread_time",
                                                        "process_time_ns", "thread_time_ns")}
        swaps = {}
        for key, value in list(namespace.items()):
            if value is time:
                swaps[key] = self.module
            elif not isinstance(value, type) and callable(value) and _hashable(value) and value in real:
                swaps[key] = getattr(self.module, real[value])

        @contextlib.contextmanager
        def swapped():
            before = {key: namespace[key] for key in swaps}
            namespace.update(swaps)
            try:
                yield
            finally:
                namespace.update(before)

        return swapped()


def _hashable(value) -> bool:
    try:
        hash(value)
    except Exception:  # noqa: BLE001 (an unhashable object in the learner's module is not a clock)
        return False
    return True


# --- 04.1 timing an asynchronous device -------------------------------------------------------

class _SimulatedGPU:
    """`launch()` queues work and returns at once, like a CUDA kernel launch; `sync()` waits for the queue
    (here: moves the simulated clock by the queued work, and sleeps for it, for a clock the swap does not reach).
    Call k queues `work[k]` seconds. Records how long each sync waited."""

    def __init__(self, work: list[float], clock: _Clock):
        self.work, self.clock = work, clock
        self.launches = 0
        self.pending: list[int] = []
        self.done: dict[int, float] = {}  # call index -> seconds its sync waited (alone in the queue)
        self.waited_for: list[list[int]] = []  # the calls each sync() waited for

    def launch(self) -> None:
        k = self.launches
        self.launches += 1
        self.pending.append(k)

    def sync(self) -> None:
        if not self.pending:
            return
        seconds = sum(self.work[k] if k < len(self.work) else self.work[-1] for k in self.pending)
        self.clock.now += seconds  # the clock the learner's code reads
        time.sleep(seconds)  # and the real one, for answers timing with another module (timeit, torch.utils.benchmark)
        self.waited_for.append(list(self.pending))
        if len(self.pending) == 1:
            self.done[self.pending[0]] = seconds
        self.pending.clear()


# warm-up calls are slow (first-call costs); one timed call is an outlier that drags a mean upwards
# and one is fast (2 ms against 4): a minimum is decided by that single call
_WORK = [0.030, 0.030, 0.030, 0.004, 0.004, 0.040, 0.002, 0.004]
_WARMUP, _REPEATS = 3, 5


def _check_median_time(median_time):
    def run():  # the simulated GPU lives where the answer runs: what it counted and timed comes back
        clock = _Clock()  # the time the answer reads moves by the work waited for: exact on any machine
        gpu = _SimulatedGPU(_WORK, clock)
        with clock.installed_in(median_time):
            result = call(median_time, gpu.launch, gpu.sync, _WARMUP, _REPEATS, name="median_time",
                          check_mutation=False)
        return result, gpu.launches, gpu.pending, gpu.done, gpu.waited_for

    result, launches, pending, done, waited_for = observe(run)
    seconds = _as_number(result, "median_time", _("a number of seconds"))
    if launches == _REPEATS:
        raise Incorrect(_("fn was called {repeats} times, not warmup + repeats = {expected}: likely "
                          "mistake: the warm-up calls are missing; the first calls pay one-time costs and must not "
                          "be timed").format(repeats=_REPEATS, expected=_WARMUP + _REPEATS))
    if launches != _WARMUP + _REPEATS:
        raise Incorrect(_("fn was called {launches} times; expected warmup + repeats = {expected}").format(
            launches=launches, expected=_WARMUP + _REPEATS))
    synced_each = not pending and all(k in done for k in range(_WARMUP, _WARMUP + _REPEATS))
    if seconds < 0.001 and synced_each:
        raise Incorrect(_("median_time returned {us:.0f} us, though each timed call was followed by its sync(), which "
                          "waited for at least 2 ms of work: likely mistake: a clock that does not count waiting, "
                          "such as time.process_time() (CPU time; a process waiting for the device uses none); read "
                          "time.perf_counter()").format(us=seconds * 1e6))
    if seconds < 0.001:
        raise Incorrect(_("median_time returned {us:.0f} us, but each call queues at least 4 ms of work: "
                          "likely mistake: the clock was read before sync() returned, so you timed the launch, not "
                          "the work. Call sync() after fn() and before reading the clock").format(us=seconds * 1e6))
    if pending:
        raise Incorrect(_("the work of the last call was never waited for: likely mistake: sync() runs before fn() "
                          "instead of after it, so each time ends before its own work is done (and includes the "
                          "previous call's). Per timed call: read the clock, fn(), sync(), read the clock"))
    if any(min(group) < _WARMUP <= max(group) for group in waited_for):
        raise Incorrect(_("the first timed sync() also waited for the warm-up's queued work: likely mistake: no "
                          "sync() after the warm-up calls, so the first timed call includes them. Call sync() once "
                          "after the warm-up, before the first clock read"))
    timed = [done[k] for k in range(_WARMUP, _WARMUP + _REPEATS) if k in done]
    if len(timed) != _REPEATS:
        raise Incorrect(_("each timed call should be followed by its own sync() (fn(), sync(), read the clock): "
                          "one sync() after several calls times them together"))
    median, mean = statistics.median(timed), statistics.fmean(timed)
    if seconds > 0.5 and abs(seconds / 1000 - median) <= 0.25 * median + 0.001:
        raise Incorrect(_("median_time returned {value:g}, a thousand times the median of the timed calls in seconds "
                          "({median:.4f} s): likely mistake: the result is in milliseconds; return seconds, as "
                          "time.perf_counter() gives them").format(value=seconds, median=median))
    every = [done[k] for k in range(_WARMUP + _REPEATS) if k in done]
    if len(every) == _WARMUP + _REPEATS:
        with_warmup = statistics.median(every)
        if abs(seconds - with_warmup) < abs(seconds - median):
            raise Incorrect(_("median_time returned {ms:.1f} ms, the median of the warm-up and the timed "
                              "calls together ({with_warmup_ms:.1f} ms), not of the timed ones "
                              "({median_ms:.1f} ms): likely mistake: the warm-up calls are timed too; leave them "
                              "out of the times").format(ms=seconds * 1e3, with_warmup_ms=with_warmup * 1e3,
                                                         median_ms=median * 1e3))
    if abs(seconds - mean) < abs(seconds - median):
        raise Incorrect(_("median_time returned {ms:.1f} ms, close to the mean of the timed calls "
                          "({mean_ms:.1f} ms), not their median ({median_ms:.1f} ms): likely mistake: the mean; "
                          "one slow call (another process, a page fault) drags it up, the median ignores it").format(
            ms=seconds * 1e3, mean_ms=mean * 1e3, median_ms=median * 1e3))
    fastest = min(timed)
    if abs(seconds - fastest) < abs(seconds - median):
        raise Incorrect(_("median_time returned {ms:.1f} ms, close to the fastest timed call ({min_ms:.1f} ms), not "
                          "their median ({median_ms:.1f} ms): likely mistake: the minimum, which a single call "
                          "decides; the median is what a typical call takes").format(
            ms=seconds * 1e3, min_ms=fastest * 1e3, median_ms=median * 1e3))
    if abs(seconds - median) > 0.25 * median + 0.001:
        raise Incorrect(_("median_time returned {ms:.1f} ms; the median of the timed calls was "
                          "{median_ms:.1f} ms").format(ms=seconds * 1e3, median_ms=median * 1e3))
    return _("{ms:.0f} ms per call: warmed up, synchronized, robust to the slow outlier").format(ms=seconds * 1e3)


_TIME_DOC = ("def median_time(fn, sync, warmup=2, repeats=5):\n"
             "    \"\"\"Seconds per call of fn: warmup untimed calls, then repeats timed calls, each followed by\n"
             "    sync() before the clock is read; return the median.\"\"\"\n")

_TIME_SOLUTION = _TIME_DOC + (
    "    for _ in range(warmup):\n"
    "        fn()\n"
    "    sync()\n"
    "    times = []\n"
    "    for _ in range(repeats):\n"
    "        start = time.perf_counter()\n"
    "        fn()\n"
    "        sync()\n"
    "        times.append(time.perf_counter() - start)\n"
    "    return statistics.median(times)\n")

register(Exercise(
    id="04.1", title=N_("Timing an asynchronous device"), answer="median_time",
    blank=_TIME_DOC + "    raise NotImplementedError  # your code here\n",
    solution=_TIME_SOLUTION,
    setup="import statistics\nimport time\n",
    checker=_check_median_time,
    timeout=5.0,
    inside=N_("the calls and the syncs of a simulated device, counted while the answer ran"),
    hints=[N_("fn() only queues the work, like a CUDA kernel launch; sync() waits until the work is done."),
           N_("Read time.perf_counter() before fn() and again after sync(); collect `repeats` such times."),
           N_("statistics.median(times).")],
    mistakes=[
        Mistake(_TIME_DOC + (
            "    times = []\n"
            "    for _ in range(warmup):\n"
            "        fn()\n"
            "    for _ in range(repeats):\n"
            "        start = time.perf_counter()\n"
            "        fn()\n"
            "        times.append(time.perf_counter() - start)\n"
            "    return statistics.median(times)\n"), "timed the launch"),
        Mistake(_TIME_DOC + (
            "    times = []\n"
            "    for _ in range(repeats):\n"
            "        start = time.perf_counter()\n"
            "        fn()\n"
            "        sync()\n"
            "        times.append(time.perf_counter() - start)\n"
            "    return statistics.median(times)\n"), "warm-up calls are missing"),
        Mistake(_TIME_DOC + (
            "    for _ in range(warmup):\n"
            "        fn()\n"
            "    sync()\n"
            "    times = []\n"
            "    for _ in range(repeats):\n"
            "        start = time.perf_counter()\n"
            "        fn()\n"
            "        sync()\n"
            "        times.append(time.perf_counter() - start)\n"
            "    return sum(times) / len(times)\n"), "the mean"),
        Mistake(_TIME_DOC + (
            "    for _ in range(warmup):\n"
            "        fn()\n"
            "    times = []\n"
            "    for _ in range(repeats):\n"
            "        start = time.perf_counter()\n"
            "        fn()\n"
            "        sync()\n"
            "        times.append(time.perf_counter() - start)\n"
            "    return statistics.median(times)\n"), "no sync() after the warm-up"),
        Mistake(_TIME_DOC + (
            "    for _ in range(warmup):\n"
            "        fn()\n"
            "    sync()\n"
            "    times = []\n"
            "    for _ in range(repeats):\n"
            "        start = time.perf_counter()\n"
            "        sync()\n"
            "        fn()\n"
            "        times.append(time.perf_counter() - start)\n"
            "    return statistics.median(times)\n"), "sync() runs before fn()"),
        Mistake(_TIME_DOC + (
            "    times = []\n"
            "    for i in range(warmup + repeats):\n"
            "        start = time.perf_counter()\n"
            "        fn()\n"
            "        sync()\n"
            "        times.append(time.perf_counter() - start)\n"
            "    return statistics.median(times)\n"), "warm-up calls are timed too"),
        Mistake(_TIME_DOC + (
            "    for _ in range(warmup):\n"
            "        fn()\n"
            "    sync()\n"
            "    start = time.perf_counter()\n"
            "    for _ in range(repeats):\n"
            "        fn()\n"
            "    sync()\n"
            "    return (time.perf_counter() - start) / repeats\n"), "times them together"),
        Mistake(_TIME_SOLUTION.replace("return statistics.median(times)", "return statistics.median(times) * 1000"),
                "in milliseconds"),
        Mistake(_TIME_SOLUTION.replace("time.perf_counter()", "time.process_time()"), "does not count waiting"),
        Mistake(_TIME_SOLUTION.replace("return statistics.median(times)", "return min(times)"), "the minimum"),
    ],
))


# --- 04.2 one sync per epoch ------------------------------------------------------------------

_LOSSES = [2.25, 1.75, 1.5, 1.0, 0.5]


def _check_epoch_mean_loss(epoch_mean_loss):
    import weakref

    weight = torch.ones((), requires_grad=True)  # the losses carry a graph, as real ones do
    calls = []
    graphs = []  # per step, a weak reference to a tensor its graph saved for backward: alive as long as the graph
    alive = []   # at each step, how many earlier steps' graphs were still alive

    def train_step():
        value = _LOSSES[len(calls) % len(_LOSSES)]
        calls.append(value)
        alive.append(sum(ref() is not None for ref in graphs))
        saved = torch.tensor(value)  # `weight * saved` keeps `saved` for the gradient of weight
        graphs.append(weakref.ref(saved))
        return on_device(weight * saved)

    def run():  # the reads are counted, and the graphs seen alive, where the answer runs
        with HostReads() as reads:
            result = call(epoch_mean_loss, train_step, len(_LOSSES), name="epoch_mean_loss", check_mutation=False)
        return result, len(calls), dict(reads.counts), alive

    result, n_calls, counts, alive_seen = observe(run)
    reads = HostReads()  # the counts as read where the answer ran, for their totals and their description
    reads.counts.update(counts)
    if n_calls != len(_LOSSES):
        raise Incorrect(_("train_step was called {calls} times for steps={steps}").format(
            calls=n_calls, steps=len(_LOSSES)))
    if reads.total >= len(_LOSSES):
        raise Incorrect(_("{total} CPU-GPU syncs for {steps} steps ({reads}): likely mistake: "
                          "the loss is brought to the host every step; each of these waits for the GPU. Keep the "
                          "running sum a tensor on the device and read it once, at the end").format(
            total=reads.total, steps=len(_LOSSES), reads=reads.describe()))
    if isinstance(result, torch.Tensor):
        raise Incorrect(_("epoch_mean_loss returned {value}: return a Python float (read it with "
                          ".item() once, at the end)").format(value=describe(result)))
    value = _as_number(result, "epoch_mean_loss", _("the mean loss as a number"))
    expected = sum(_LOSSES) / len(_LOSSES)
    if math.isclose(value, sum(_LOSSES)):
        raise Incorrect(_("got {value}, the sum of the losses: divide by the number of steps for the mean").format(
            value=value))
    if not math.isclose(value, expected, rel_tol=1e-6):
        raise Incorrect(_("the mean of the losses {losses} is {expected}, got {value!r}").format(
            losses=_LOSSES, expected=expected, value=value))
    if reads.total > 1:
        raise Incorrect(_("{total} syncs ({reads}): one is enough (a single .item() at the end)").format(
            total=reads.total, reads=reads.describe()))
    if alive_seen and alive_seen[-1] >= len(_LOSSES) - 1:
        raise Incorrect(_("at the last step the autograd graphs of all {kept} earlier steps were still alive: likely "
                          "mistake: the losses were kept without .detach() (total += loss, or a list of the losses "
                          "themselves); each keeps its step's graph, so memory grows with the epoch. Keep "
                          "train_step().detach()").format(kept=alive_seen[-1]))
    return _("the mean loss of the epoch, read with a single sync")


_EPOCH_DOC = ("def epoch_mean_loss(train_step, steps):\n"
              "    \"\"\"Call train_step() steps times (each returns that step's loss, a 0-d tensor on the device)\n"
              "    and return the mean loss as a Python float, with one CPU-GPU sync at the end.\"\"\"\n")

register(Exercise(
    id="04.2", title=N_("One sync per epoch"), answer="epoch_mean_loss",
    blank=_EPOCH_DOC + "    raise NotImplementedError  # your code here\n",
    solution=_EPOCH_DOC + (
        "    losses = [train_step().detach() for _ in range(steps)]\n"
        "    return torch.stack(losses).mean().item()  # the one sync\n"),
    setup="import torch\n",
    checker=_check_epoch_mean_loss,
    inside=N_("host reads and live autograd graphs, counted while the answer ran"),
    hints=[N_("Adding tensors on the device queues work without waiting for it; .item() waits."),
           N_("Keep the detached losses (or a running tensor sum) and call .item() once, on the mean.")],
    mistakes=[
        Mistake(_EPOCH_DOC + "    return sum(train_step().item() for _ in range(steps)) / steps\n", ".item() x5"),
        Mistake(_EPOCH_DOC + ("    total = 0.0\n    for _ in range(steps):\n        total += float(train_step())\n"
                              "    return total / steps\n"), "float() x5"),
        Mistake(_EPOCH_DOC + ("    losses = []\n    for step in range(steps):\n        loss = train_step()\n"
                              "        print(f\"step {step}: loss {loss:.3f}\")\n        losses.append(loss.detach())\n"
                              "    return torch.stack(losses).mean().item()\n"), "formatting (an f-string) x5"),
        Mistake(_EPOCH_DOC + ("    losses = [train_step().detach().cpu() for _ in range(steps)]\n"
                              "    return torch.stack(losses).mean().item()\n"), ".cpu() x5"),
        Mistake(_EPOCH_DOC + ("    losses = []\n    for _ in range(steps):\n        loss = train_step().detach()\n"
                              "        if torch.isnan(loss):\n            raise FloatingPointError(\"the loss is NaN\")\n"
                              "        losses.append(loss)\n    return torch.stack(losses).mean().item()\n"),
                "bool() (an if) x5"),
        Mistake(_EPOCH_DOC + ("    losses = [train_step().detach() for _ in range(steps)]\n"
                              "    print(\"mean loss:\", torch.stack(losses).mean())\n"
                              "    return torch.stack(losses).mean().item()\n"), "one is enough"),
        Mistake(_EPOCH_DOC + "    return torch.stack([train_step().detach() for _ in range(steps)]).mean()\n",
                "return a Python float"),
        Mistake(_EPOCH_DOC + "    return torch.stack([train_step().detach() for _ in range(steps)]).sum().item()\n",
                "divide by the number of steps"),
        Mistake(_EPOCH_DOC + ("    total = 0.0\n    for _ in range(steps):\n        total += train_step()\n"
                              "    return (total / steps).item()\n"), "without .detach()"),
        Mistake(_EPOCH_DOC + ("    losses = [train_step() for _ in range(steps)]\n"
                              "    return torch.stack(losses).mean().item()\n"), "without .detach()"),
        Mistake(_EPOCH_DOC + ("    losses = [train_step().detach() for _ in range(1, steps)]\n"
                              "    return torch.stack(losses).mean().item()\n"), "train_step was called 4 times"),
    ],
))


# --- 04.3 a fair speed-up under changing load -------------------------------------------------------

class _Machine:
    """A simulated machine whose load grows while you measure: the n-th call costs its work times
    (1 + 0.05 n). `clock()` reads its time in seconds. Each function's first call pays a one-time cost,
    and one call of `candidate` (the 3rd) is hit by a page fault."""

    def __init__(self, baseline_s: float = 0.010, candidate_s: float = 0.004):
        self.now = 0.0
        self.calls: list[str] = []           # "b" or "c", in order
        self.durations: list[float] = []     # simulated seconds of each call
        self.cost = {"b": baseline_s, "c": candidate_s}
        self.clock_reads = 0
        self.calls_at_first_read: int | None = None  # calls made before clock() was first read
        self.true_speedup = baseline_s / candidate_s

    def clock(self) -> float:
        if self.calls_at_first_read is None:
            self.calls_at_first_read = len(self.calls)
        self.clock_reads += 1
        return self.now

    def run(self, which: str) -> None:
        load = 1 + 0.05 * len(self.calls)
        seconds = self.cost[which] * load
        if which not in self.calls:
            seconds += 0.050  # first call: one-time costs (allocations, kernel selection, compilation)
        if which == "c" and self.calls.count("c") == 3:
            seconds *= 10  # a page fault, another process: one slow call
        self.calls.append(which)
        self.durations.append(seconds)
        self.now += seconds


def _check_speedup(speedup):
    if observe(lambda: isinstance(speedup, type) or not callable(speedup)):
        raise Incorrect(_("speedup should be a function, got {value}").format(value=describe(observe(lambda: speedup))))
    rounds = 7  # not the default: the answer must use its argument

    def run():  # the simulated machine lives where the answer runs: what it counted comes back
        machine = _Machine()
        result = call(speedup, lambda: machine.run("b"), lambda: machine.run("c"), machine.clock, rounds,
                      name="speedup", check_mutation=False)
        return result, machine.calls, machine.clock_reads, machine.calls_at_first_read

    result, calls, clock_reads, calls_at_first_read = observe(run)
    value = _as_number(result, "speedup", _("a number (how many times faster candidate is)"))
    if clock_reads == 0:
        raise Incorrect(_("clock() was never read: likely mistake: timing with time.perf_counter(); this machine is "
                          "simulated, so time it with the clock you are given"))
    n_b, n_c = calls.count("b"), calls.count("c")
    if (n_b, n_c) == (rounds, rounds) and calls_at_first_read == 2 and sorted(calls[:2]) == ["b", "c"]:
        raise Incorrect(_("each function was called {rounds} times: once untimed (the warm-up), then only {timed} "
                          "timed rounds for rounds={rounds}: likely mistake: a loop that stops one round short "
                          "(range(1, rounds)); time `rounds` rounds after the warm-up").format(
            rounds=rounds, timed=rounds - 1))
    if (n_b, n_c) == (6, 6):
        raise Incorrect(_("each function was called 6 times for rounds={rounds}, one warm-up and 5 rounds: likely "
                          "mistake: the 5 rounds of the default are written in the code; use the `rounds` "
                          "argument").format(rounds=rounds))
    if (n_b, n_c) == (rounds, rounds):
        raise Incorrect(_("each function was called {rounds} times, not rounds + 1 = {expected}: likely mistake: "
                          "the warm-up call is missing; the first call of each pays one-time costs and must not be "
                          "timed").format(rounds=rounds, expected=rounds + 1))
    if (n_b, n_c) != (rounds + 1, rounds + 1):
        raise Incorrect(_("baseline was called {n_b} times and candidate {n_c}; expected rounds + 1 = {expected} "
                          "each (one warm-up, then one per round)").format(n_b=n_b, n_c=n_c, expected=rounds + 1))
    true = _Machine().true_speedup  # the checker's own: the speed-up the simulation is built with
    if abs(value / true - 1) < 0.06:
        return _("{value:.2f}x (the true speed-up is {true:.2f}x): alternating keeps both under the same load, "
                 "and the median of the rounds ignores the slow call").format(value=value, true=true)
    if abs(value * true - 1) < 0.2:
        raise Incorrect(_("speedup returned {value:.2f}, below 1: likely mistake: the ratio is inverted; the "
                          "speed-up is baseline's time / candidate's time").format(value=value))
    timed = calls[2:] if calls[:2] in (["b", "c"], ["c", "b"]) else calls
    if timed in (["b"] * rounds + ["c"] * rounds, ["c"] * rounds + ["b"] * rounds):
        raise Incorrect(_("speedup returned {value:.2f}x, the true speed-up is {true:.2f}x: likely mistake: all "
                          "calls of one function, then all of the other; the load changed in between, so they were "
                          "measured on different machines. Alternate: one call of each per round").format(
            value=value, true=true))
    raise Incorrect(_("speedup returned {value:.2f}x; the true speed-up is {true:.2f}x: likely mistake: one slow "
                      "call (a page fault) dragged a sum or a mean, or each function's times were summarised "
                      "separately although the load differed between them. Take the ratio within each round "
                      "(the two calls ran under the same load) and return the median of those ratios").format(
        value=value, true=true))


_SPEEDUP_DOC = ("def speedup(baseline, candidate, clock, rounds=5):\n"
                "    \"\"\"How many times faster candidate() runs than baseline(), measured fairly while the machine's\n"
                "    load changes: one untimed call of each, then `rounds` timed calls of each; clock() reads seconds.\"\"\"\n")
_SPEEDUP_HEAD = _SPEEDUP_DOC + "    baseline()\n    candidate()  # warm-up: first calls pay one-time costs\n"


def _timed(fn: str) -> str:
    return f"        start = clock()\n        {fn}()\n        t_{fn[0]} = clock() - start\n"


_SPEEDUP_SOLUTION = _SPEEDUP_HEAD + (
    "    ratios = []\n"
    "    for _ in range(rounds):  # in alternation: a change of load hits both alike\n"
    + _timed("baseline") + _timed("candidate") +
    "        ratios.append(t_b / t_c)\n"
    "    return statistics.median(ratios)\n")

register(Exercise(
    id="04.3", title=N_("A fair speed-up under changing load"), answer="speedup",
    blank=_SPEEDUP_DOC + "    raise NotImplementedError  # your code here\n",
    solution=_SPEEDUP_SOLUTION,
    setup="import statistics\nimport time\n",
    checker=_check_speedup,
    inside=N_("the calls and clock reads of a simulated machine, counted while the answer ran"),
    hints=[N_("Time each call with two readings of clock(). Alternate: baseline, candidate, baseline, candidate, "
              "... so that whatever else the machine is doing weighs on both alike."),
           N_("Within a round the two calls ran under the same load: their ratio is fair. Across rounds the load "
              "moves and one call may be slow: take the median of the rounds' ratios.")],
    mistakes=[
        Mistake(_SPEEDUP_HEAD + (
            "    t_b, t_c = [], []\n"
            "    for _ in range(rounds):\n        start = clock()\n        baseline()\n"
            "        t_b.append(clock() - start)\n"
            "    for _ in range(rounds):\n        start = clock()\n        candidate()\n"
            "        t_c.append(clock() - start)\n"
            "    return statistics.median(t_b) / statistics.median(t_c)\n"), "Alternate"),
        Mistake(_SPEEDUP_DOC + (
            "    ratios = []\n    for _ in range(rounds):\n" + _timed("baseline") + _timed("candidate")
            + "        ratios.append(t_b / t_c)\n    return statistics.median(ratios)\n"), "warm-up call is missing"),
        Mistake(_SPEEDUP_HEAD + (
            "    total_b = total_c = 0.0\n    for _ in range(rounds):\n" + _timed("baseline") + _timed("candidate")
            + "        total_b += t_b\n        total_c += t_c\n    return total_b / total_c\n"), "one slow"),
        Mistake(_SPEEDUP_HEAD + (
            "    ratios = []\n    for _ in range(rounds):\n" + _timed("baseline") + _timed("candidate")
            + "        ratios.append(t_b / t_c)\n    return sum(ratios) / len(ratios)\n"), "median of those ratios"),
        Mistake(_SPEEDUP_HEAD + (
            "    ratios = []\n    for _ in range(rounds):\n" + _timed("baseline") + _timed("candidate")
            + "        ratios.append(t_c / t_b)\n    return statistics.median(ratios)\n"), "inverted"),
        Mistake(_SPEEDUP_HEAD + (
            "    ratios = []\n    for _ in range(rounds):\n"
            "        start = time.perf_counter()\n        baseline()\n        t_b = time.perf_counter() - start\n"
            "        start = time.perf_counter()\n        candidate()\n        t_c = time.perf_counter() - start\n"
            "        ratios.append(t_b / t_c)\n    return statistics.median(ratios)\n"), "time.perf_counter()"),
        Mistake(_SPEEDUP_SOLUTION.replace("for _ in range(rounds):", "for _ in range(5):"),
                "use the `rounds` argument"),
        Mistake(_SPEEDUP_SOLUTION.replace("for _ in range(rounds):", "for _ in range(1, rounds):"),
                "stops one round short"),
    ],
))


# --- 04.4 host reads per step, from a profile ---------------------------------------------------------

def _toy_step(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A training step in miniature: forward, backward; returns the loss (a 0-d tensor)."""
    w.grad = None
    loss = ((w * x) ** 2).mean()
    loss.backward()
    return loss.detach()


def _loop_item(w, x, steps):
    for _step in range(steps):
        _toy_step(w, x).item()


def _loop_float_and_if(w, x, steps):
    running = 0.0
    for _step in range(steps):
        loss = _toy_step(w, x)
        running += float(loss)
        if loss > 1e6:  # an `if` on a tensor: bool(), a read
            raise FloatingPointError("diverged")


def _loop_once(w, x, steps):
    total = torch.zeros(())
    for _step in range(steps):
        total += _toy_step(w, x)
    (total / steps).item()


def _loop_format(w, x, steps):
    lines = []
    for step in range(steps):
        loss = _toy_step(w, x)
        lines.append(f"step {step}: {loss:.3f}, x[0] {int(x[0])}")  # formatting and int(): two reads


def _loop_none(w, x, steps):
    for _step in range(steps):
        _toy_step(w, x)


# (what the loop does, reads per step, the loop, steps profiled)
_PROFILED = [
    (N_("loss.item() every step"), 1.0, _loop_item, 5),
    (N_("float(loss) and an `if loss > ...` every step"), 2.0, _loop_float_and_if, 4),
    (N_("one .item() after all the steps"), 0.25, _loop_once, 4),
    (N_("an f-string of the loss and int() of a tensor every step"), 2.0, _loop_format, 3),
    (N_("no read at all"), 0.0, _loop_none, 3),
]


_PROFILES: dict = {}  # (loop, steps) -> (the profile, its rows when made)


def _rows(prof) -> list:
    return [(e.key, e.count, e.cpu_time_total, e.self_cpu_time_total) for e in prof.key_averages()]


def _profile(loop, steps):
    """A profile of `loop` over `steps` steps, made once per process and kept: an answer checked twice is handed the
    same profile, times included (they are in the feedback on a time column). Made again if an answer changed it."""
    from torch.profiler import ProfilerActivity, profile

    kept = _PROFILES.get((loop, steps))
    if kept is not None:
        try:
            if _rows(kept[0]) == kept[1]:
                return kept[0]
        except Exception:  # noqa: BLE001 (an answer broke the profile it was given: make a new one)
            pass
    w, x = torch.ones(8, requires_grad=True), torch.linspace(0.5, 1.5, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loop(w, x, steps)
    _PROFILES[(loop, steps)] = (prof, _rows(prof))
    return prof


def _times(prof, steps) -> list[float]:
    """The time columns of the read operators' rows (whole, and per step): what a time mistaken for a count gives."""
    times = []
    for event in prof.key_averages():
        if event.key in (_READ_OP, _ITEM_OP):
            for attr in ("cpu_time_total", "self_cpu_time_total", "cpu_time"):
                value = float(getattr(event, attr))
                times += [value, value / steps]
    return times


def _near(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def _check_syncs_per_step(syncs_per_step):
    if observe(lambda: isinstance(syncs_per_step, type) or not callable(syncs_per_step)):
        raise Incorrect(_("syncs_per_step should be a function, got {value}").format(
            value=describe(observe(lambda: syncs_per_step))))
    runs = []  # (label, expected, got, steps, prof)
    for label, expected, loop, steps in _PROFILED:
        prof = hold(lambda: _profile(loop, steps))  # profiled where the answer reads it (its times are that process's)
        try:
            got = observe(lambda: call(syncs_per_step, prof, steps, name="syncs_per_step", check_mutation=False))
        except Incorrect as exc:
            if expected == 0 and any(kind in str(exc) for kind in ("IndexError", "StopIteration", "KeyError")):
                raise Incorrect(_("for a loop with no read at all, {error}: likely mistake: when nothing was read the "
                                  "profile has no row for the operator, so the list of its rows is empty; add up the "
                                  "counts of the matching rows (0 when there are none)").format(error=exc)) from None
            raise
        runs.append((label, expected, _as_number(got, "syncs_per_step", _("a number of reads per step")), steps,
                     prof))
    wrong = [r for r in runs if not _near(r[2], r[1])]
    if not wrong:
        return _("every loop's reads per step, counted once each, from the profile's calls")
    if all(_near(got, expected * steps) for _, expected, got, steps, _ in runs):
        raise Incorrect(_("you returned the reads of the whole profile (e.g. 5 for .item() in each of 5 steps): "
                          "likely mistake: not divided by steps. The question is per step: divide by `steps`"))
    if all(_near(got, 2 * expected) for _, expected, got, _, _ in runs):
        raise Incorrect(_("twice the right number for every loop: likely mistake: each read counted twice. "
                          "{item_op} calls {read_op} and the profile records both, nested: count one of them").format(
            item_op=_ITEM_OP, read_op=_READ_OP))
    for label, expected, got, steps, prof in runs:
        if expected <= 0:
            continue
        times = observe(lambda: _times(prof, steps))
        if any(_near(got, t) for t in times) and not _near(got, expected):
            raise Incorrect(_("for {label} you returned {got:g}, which is a time in microseconds, not a count: "
                              "likely mistake: a time column (cpu_time_total, ...) instead of the number of calls. "
                              "Read the event's count").format(label=_(label), got=got))
    fractional = [r for r in runs if r[1] != int(r[1])]
    if fractional and all(_near(got, math.floor(expected)) or _near(got, round(expected))
                          for _, expected, got, _, _ in fractional) and all(
            _near(got, expected) for _, expected, got, _, _ in runs if expected == int(expected)):
        label, expected, got, steps, _prof = fractional[0]
        raise Incorrect(_("for {label} ({steps} steps) you returned {got:g}, not {expected:g}: likely mistake: "
                          "rounded to a whole number (//, int() or round()); one read every 4 steps is 0.25 per "
                          "step: use / and keep the fraction").format(
            label=_(label), steps=steps, got=got, expected=expected))
    reading = [(expected * steps, got, steps) for _, expected, got, steps, _ in runs if expected > 0]
    divisors = {round(reads / got, 6) for reads, got, _steps in reading if got > 0}
    if (len(divisors) == 1 and all(got > 0 for _r, got, _s in reading)
            and len({steps for _r, _g, steps in reading}) > 1):
        divisor = divisors.pop()
        if any(not _near(divisor, steps) for _r, _g, steps in reading):
            raise Incorrect(_("every loop's reads were divided by {divisor:g}, though the profiles cover {steps} "
                              "steps: likely mistake: a fixed number of steps written in the code; divide by the "
                              "`steps` argument").format(divisor=divisor,
                                                          steps=", ".join(str(r[3]) for r in runs)))
    label, expected, got, steps, _prof = wrong[0]
    raise Incorrect(_("for a loop with {label}, profiled for {steps} steps, there are {expected:g} reads per step; "
                      "syncs_per_step returned {got:g}. Every read of a tensor's value (.item(), float(), int(), "
                      "bool(), formatting) shows up as one call of the same operator: find it in the table").format(
        label=_(label), steps=steps, expected=expected, got=got))


_SYNCS_DOC = ("def syncs_per_step(prof, steps):\n"
              "    \"\"\"Host reads of a tensor's value per step (.item(), float(), int(), bool() or an `if` on a\n"
              "    tensor, formatting: each a CPU-GPU sync point on a GPU), counted in a finished torch.profiler\n"
              "    profile `prof` of `steps` steps.\"\"\"\n")

register(Exercise(
    id="04.4", title=N_("Host reads per step, from a profile"), answer="syncs_per_step",
    blank=_SYNCS_DOC + "    raise NotImplementedError  # your code here\n",
    solution=_SYNCS_DOC + (
        "    reads = sum(e.count for e in prof.key_averages() if e.key == \"aten::_local_scalar_dense\")\n"
        "    return reads / steps\n"),
    checker=_check_syncs_per_step,
    timeout=30.0,
    hints=[N_("prof.key_averages() has one row per operator name (`.key`), with `.count`, the number of calls. "
              "Which operator does every read go through? The table of the naive loop and the cell before this "
              "exercise show it."),
           N_("aten::item calls aten::_local_scalar_dense: a read appears under both names. Count the calls of "
              "one of them and divide by steps (with /: a read every 4 steps is 0.25).")],
    mistakes=[
        Mistake(_SYNCS_DOC + "    return sum(e.count for e in prof.key_averages() "
                             "if e.key == \"aten::_local_scalar_dense\")\n", "not divided by steps"),
        Mistake(_SYNCS_DOC + ("    names = (\"aten::item\", \"aten::_local_scalar_dense\")\n"
                              "    return sum(e.count for e in prof.key_averages() if e.key in names) / steps\n"),
                "each read counted twice"),
        Mistake(_SYNCS_DOC + ("    return sum(e.cpu_time_total for e in prof.key_averages()\n"
                              "               if e.key == \"aten::_local_scalar_dense\") / steps\n"),
                "a time column"),
        Mistake(_SYNCS_DOC + ("    reads = sum(e.count for e in prof.key_averages() if e.key == \"aten::item\")\n"
                              "    return reads // steps\n"), "rounded to a whole number"),
        Mistake(_SYNCS_DOC + ("    copies = [e for e in prof.key_averages() if e.key == \"aten::copy_\"]\n"
                              "    return sum(e.count for e in copies) / steps\n"), "find it in the table"),
        Mistake(_SYNCS_DOC + ("    row = [e for e in prof.key_averages()\n"
                              "           if e.key == \"aten::_local_scalar_dense\"][0]\n"
                              "    return row.count / steps\n"), "no row for the operator"),
        Mistake(_SYNCS_DOC + ("    reads = sum(e.count for e in prof.key_averages() "
                              "if e.key == \"aten::_local_scalar_dense\")\n"
                              "    return round(reads / steps)\n"), "round()"),
        Mistake(_SYNCS_DOC + ("    reads = sum(e.count for e in prof.key_averages() "
                              "if e.key == \"aten::_local_scalar_dense\")\n"
                              "    return reads / 5\n"), "a fixed number of steps"),
    ],
))


# --- 04.5 the fastest thread count, measured on a busy machine -----------------------------------------------------

class _ThreadedStep:
    """A step whose time depends on torch.get_num_threads() as it runs: `ms[n]` seconds per call, the first
    `slow_first[n]` calls under count n 40 ms slower (warm-up), and outliers: `{(n, k): seconds}` replaces the time of
    the k-th call under count n (counted from 1). `fail_at`: raise RuntimeError under that count."""

    def __init__(self, ms: dict[int, float], slow_first: dict[int, int] | None = None,
                 outliers: dict[tuple[int, int], float] | None = None, fail_at: int | None = None,
                 clock: _Clock | None = None):
        self.ms, self.slow_first = ms, slow_first or {}
        self.outliers, self.fail_at, self.clock = outliers or {}, fail_at, clock
        self.calls: dict[int, int] = {}

    def __call__(self):
        n = torch.get_num_threads()
        k = self.calls[n] = self.calls.get(n, 0) + 1
        if n == self.fail_at:
            raise RuntimeError(_("out of memory with {n} threads").format(n=n))
        seconds = self.outliers.get((n, k), self.ms.get(n, 0.010) + (0.040 if k <= self.slow_first.get(n, 0) else 0))
        if self.clock is not None:
            self.clock.now += seconds  # the clock the learner's code reads
        time.sleep(seconds)  # and the real one, for answers timing with another module (timeit, torch.utils.benchmark)


def _check_fastest_threads(fastest_threads):
    # torch's thread count is the count of the process where the answer runs: read there, and put back there by
    # every observation below (_under_threads), whatever the answer left
    before = observe(lambda: torch.get_num_threads())
    return _check_threads(fastest_threads, before)


def _under_threads(start: int, fn):
    """fn() with torch at `start` threads, then torch's count put back as it was (also if fn raises): (what fn
    returned, the count fn left)."""
    was = torch.get_num_threads()
    torch.set_num_threads(start)
    try:
        out = fn()
        return out, torch.get_num_threads()
    finally:
        torch.set_num_threads(was)


def _run_counted(fastest_threads, clock: _Clock, step, start: int, *args, earlier: tuple = (), **kwargs):
    """Call the answer with torch at `start` threads; check it ran step() warmup + repeats times under each count and
    put `start` back. `earlier`: the counts of the calls before this one."""
    counts = list(kwargs.get("counts", args[0] if args else (1, 2)))
    warmup, repeats = kwargs.get("warmup", args[1] if len(args) > 1 else 2), kwargs.get("repeats", 5)

    def run():  # the step counts its calls under each thread count where the answer runs
        with clock.installed_in(fastest_threads):
            out, now = _under_threads(start, lambda: call(fastest_threads, step, *args, name="fastest_threads",
                                                          check_mutation=False, **kwargs))
        is_int = isinstance(out, int) and not isinstance(out, bool)
        if is_int:
            out = int(out)
        elif type(out).__module__ == "numpy":  # shown as what it is (observed, a NumPy int would be a plain int)
            out = Opaque(type(out).__name__, describe(out), short(out))
        return out, is_int, now, step.calls

    result, is_int, now, calls = observe(run)
    if not is_int:
        raise Incorrect(_("fastest_threads returned {value}; expected one of the thread counts it was given, "
                          "an int").format(value=describe(result)))
    missing, extra = sorted(set(counts) - set(calls)), sorted(set(calls) - set(counts))
    if missing:
        raise Incorrect(_("step never ran under {missing} thread(s), one of the counts {counts}: likely mistake: "
                          "torch.set_num_threads(n) must be called for each count in `counts` before timing it").format(
            missing=missing, counts=counts))
    if extra:
        raise Incorrect(_("step also ran under {extra} thread(s), which is not in {counts}: likely mistake: some calls "
                          "(the warm-up?) run before torch.set_num_threads(n); set the count before the warm-up "
                          "calls").format(extra=extra, counts=counts))
    expected = warmup + repeats
    if any(calls[n] != expected for n in counts):
        if sum(calls.values()) == expected * len(counts):
            raise Incorrect(_("step was called {calls} times under the counts {counts}: the warm-up ran under "
                              "another thread count; set the count before the warm-up calls").format(
                calls=[calls[n] for n in counts], counts=counts))
        raise Incorrect(_("with warmup={warmup} and repeats={repeats}, step was called {calls} times under the "
                          "counts {counts}; expected warmup + repeats = {expected} under each (use the arguments, "
                          "not fixed numbers)").format(warmup=warmup, repeats=repeats,
                                                       calls=[calls[n] for n in counts], counts=counts,
                                                       expected=expected))
    if now != start:
        raise Incorrect(_("after fastest_threads, torch uses {now} threads; it used {start} before the call: read "
                          "torch.get_num_threads() at the start and put that count back, or every later cell runs "
                          "with the count timed last").format(now=now, start=start))
    if result not in counts and result in earlier:
        raise Incorrect(_("fastest_threads returned {value}, not one of {counts}, but a count of an earlier call: "
                          "likely mistake: the medians outlive the call (a dict created outside fastest_threads), so "
                          "the counts timed before still compete; create it inside the function, at each "
                          "call").format(value=result, counts=counts))
    if result not in counts:
        raise Incorrect(_("fastest_threads returned {value}, not one of {counts}").format(value=result, counts=counts))
    return result


def _check_threads(fastest_threads, before: int):
    import inspect

    def parameters():
        try:
            signature = inspect.signature(fastest_threads)
        except (TypeError, ValueError):
            return None
        return [(p.name, p.default is p.empty, None if p.default is p.empty else p.default)
                for p in signature.parameters.values()]

    params = observe(parameters)
    if params is not None and params != [("step", True, None), ("counts", False, (1, 2)), ("warmup", False, 2),
                                         ("repeats", False, 5)]:
        raise Incorrect(_("the signature must stay fastest_threads(step, counts=(1, 2), warmup=2, repeats=5), in "
                          "that order and with those defaults; yours is fastest_threads{signature}").format(
            signature=observe(lambda: str(inspect.signature(fastest_threads)))))
    # The simulated steps, timed on a simulated clock (exact on any machine), then a real step.
    _check_simulated(fastest_threads, _Clock())
    return _check_real(fastest_threads, before)


def _check_simulated(fastest_threads, clock: _Clock) -> None:
    # 1 thread is faster once warmed up (4 ms against 12 ms); under 2 threads one call is an outlier of 0 ms, the last
    # one timed: a minimum, or a single call, picks 2. The counts in both orders: an answer whose times measure
    # nothing picks by order.
    picks = {}
    for counts in ((1, 2), (2, 1)):
        step = _ThreadedStep({1: 0.004, 2: 0.012}, slow_first={1: 2, 2: 2}, outliers={(2, 7): 0.0}, clock=clock)
        args = () if counts == (1, 2) else (counts,)
        picks[counts] = _run_counted(fastest_threads, clock, step, 3, *args)  # 3 threads before: not a count it times
    if picks[(1, 2)] != picks[(2, 1)]:
        raise Incorrect(_("fastest_threads returned {a} for counts (1, 2) and {b} for (2, 1): the answer follows the "
                          "order of the counts, as if the times measured nothing: likely mistake: the clock does not "
                          "time step(); read time.perf_counter() just before and just after each timed call "
                          "(time.process_time() counts CPU time, and a step that waits uses none)").format(
            a=picks[(1, 2)], b=picks[(2, 1)]))
    if picks[(1, 2)] != 1:
        raise Incorrect(_("fastest_threads returned 2, but once warmed up a step takes 4 ms with 1 thread and 12 ms "
                          "with 2, except one call under 2 threads that took 0 ms: likely mistake: the slowest count "
                          "is returned, or a figure that one call decides (the minimum, a single call); return the "
                          "count with the smallest median"))
    # 2 threads faster (6 ms against 10 ms); under 2 threads the warm-up is slow and one timed call is 66 ms: a mean or
    # a maximum, or warm-up calls timed too, pick 3. Other counts and arguments, by keyword.
    step = _ThreadedStep({2: 0.006, 3: 0.010}, slow_first={2: 3}, outliers={(2, 5): 0.066}, clock=clock)
    result = _run_counted(fastest_threads, clock, step, 1, counts=(2, 3), warmup=3, repeats=5, earlier=(1, 2))
    if result != 2:
        raise Incorrect(_("with counts=(2, 3), warmup=3, repeats=5, fastest_threads returned 3; with 2 threads a step "
                          "takes 6 ms after 3 slow warm-up calls, except one timed call slowed to 66 ms by another "
                          "program, with 3 threads 10 ms: likely mistake: the warm-up calls are timed too, or the "
                          "mean (or maximum), which one slow call drags up; the median of the calls after the warm-up "
                          "ignores it"))
    # an error in the step must reach the caller, with the thread count put back
    failing = _ThreadedStep({1: 0.002, 2: 0.002}, fail_at=1, clock=clock)

    def attempt():
        try:
            fastest_threads(failing, (1, 2), 2, 5)
        except RuntimeError:
            return "raised", None
        except (AnswerTimeout, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 (the learner's own error: reported)
            return "other", type(exc).__name__
        return "returned", None

    def run_failing():
        with clock.installed_in(fastest_threads):
            return _under_threads(2, attempt)

    (outcome, kind), now = observe(run_failing)
    if outcome == "other":
        raise Incorrect(_("when step raised RuntimeError, fastest_threads raised {kind} instead: let the step's "
                          "error reach the caller").format(kind=kind))
    if outcome == "returned":
        raise Incorrect(_("step raised RuntimeError under 1 thread, but fastest_threads returned normally: the "
                          "error must reach the caller (do not catch it)"))
    if now != 2:
        raise Incorrect(_("when step raised, torch was left with {now} threads instead of the 2 it had: put the count "
                          "read at the start back in a `finally:` block, so it is restored on errors too").format(
            now=now))
    return None


def _check_real(fastest_threads, before: int):
    """A real step beside a busy core: whatever wins there, the answer is one of the counts and nothing is left
    changed."""
    from ..threads import BusyCores

    def run():
        model = torch.nn.Linear(256, 256)
        x = torch.randn(512, 256)

        def real_step():
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()

        with BusyCores(1):
            return _under_threads(before, lambda: call(fastest_threads, real_step, (1, 2), 2, 5,
                                                       name="fastest_threads", check_mutation=False))

    real, now = observe(run)
    if real not in (1, 2) or now != before:
        raise Incorrect(_("on a real step beside a busy core fastest_threads returned {value} and left {now} "
                          "threads (expected one of [1, 2], and {before} threads)").format(
            value=describe(real), now=now, before=before))
    return _("measured under each count after a warm-up, the median compared, the thread count put back (also on "
             "errors); beside a busy core, {real} thread(s) won on a real step this time").format(real=real)


_THREADS_DOC = ("def fastest_threads(step, counts=(1, 2), warmup=2, repeats=5):\n"
                "    \"\"\"The thread count in `counts` under which step() is fastest: for each count n, set\n"
                "    torch.set_num_threads(n), call step() `warmup` times untimed, then time `repeats` calls and take\n"
                "    the median. Put torch's thread count back as it was, also if step() raises.\"\"\"\n")
_THREADS_BODY = (
    "    before = torch.get_num_threads()\n"
    "    medians = {}\n"
    "    try:\n"
    "        for n in counts:\n"
    "            torch.set_num_threads(n)\n"
    "            for _ in range(warmup):\n"
    "                step()\n"
    "            times = []\n"
    "            for _ in range(repeats):\n"
    "                start = time.perf_counter()\n"
    "                step()\n"
    "                times.append(time.perf_counter() - start)\n"
    "            medians[n] = statistics.median(times)\n"
    "    finally:\n"
    "        torch.set_num_threads(before)\n"
    "    return min(medians, key=medians.get)\n")

register(Exercise(
    id="04.5", title=N_("The fastest thread count, measured"), answer="fastest_threads",
    blank=_THREADS_DOC + "    raise NotImplementedError  # your code here\n",
    solution=_THREADS_DOC + _THREADS_BODY,
    setup="import os\nimport statistics\nimport time\n\nimport torch\n",
    checker=_check_fastest_threads,
    timeout=60.0,
    inside=N_("torch's thread count, and the calls of step() under each count, seen while the answer ran"),
    hints=[N_("For each n: torch.set_num_threads(n), the warm-up calls, then the timed calls "
              "(time.perf_counter() before and after each). On the CPU nothing runs asynchronously: no sync needed."),
           N_("Keep the medians in a dict keyed by n and return min(medians, key=medians.get)."),
           N_("before = torch.get_num_threads() first; the loop inside try:, torch.set_num_threads(before) in "
              "finally:.")],
    mistakes=[
        Mistake(_THREADS_DOC + _THREADS_BODY.replace("    finally:\n        torch.set_num_threads(before)\n",
                                                     "    finally:\n        pass\n"), "it used 3 before the call"),
        Mistake(_THREADS_DOC + _THREADS_BODY.replace(
            "    try:\n", "    if True:\n").replace("    finally:\n        torch.set_num_threads(before)\n", "")
            .replace("    return min(", "    torch.set_num_threads(before)\n    return min("), "`finally:` block"),
        Mistake(_THREADS_DOC + _THREADS_BODY.replace("statistics.median(times)", "sum(times) / len(times)"),
                "or the mean"),
        Mistake(_THREADS_DOC + _THREADS_BODY.replace(
            "            for _ in range(warmup):\n                step()\n", ""), "expected warmup + repeats"),
        Mistake(_THREADS_DOC + _THREADS_BODY.replace("min(medians", "max(medians"), "the slowest count"),
        Mistake(_THREADS_DOC + _THREADS_BODY.replace("    return min(medians, key=medians.get)\n",
                                                     "    return min(medians.values())\n"),
                "expected one of the thread counts"),
        Mistake(_THREADS_DOC + _THREADS_BODY.replace("            torch.set_num_threads(n)\n", ""),
                "torch.set_num_threads(n) must be called"),
        Mistake(_THREADS_DOC + _THREADS_BODY.replace("        torch.set_num_threads(before)\n",
                                                     "        torch.set_num_threads(os.cpu_count())\n"),
                "it used 3 before the call"),
        Mistake(_THREADS_DOC + _THREADS_BODY.replace("        for n in counts:\n",
                                                     "        for n in counts:\n          try:\n").replace(
            "            medians[n] = statistics.median(times)\n",
            "            medians[n] = statistics.median(times)\n          except RuntimeError:\n"
            "            medians[n] = float('inf')\n"), "the error must reach the caller"),
        # written as learners write them, found by a review of the first checker:
        Mistake(_THREADS_DOC + _THREADS_BODY.replace("range(warmup)", "range(2)").replace("range(repeats)",
                                                                                          "range(5)"),
                "use the arguments"),
        Mistake(_THREADS_DOC + _THREADS_BODY.replace(
            "            for _ in range(warmup):\n                step()\n            times = []\n"
            "            for _ in range(repeats):\n",
            "            times = []\n            for _ in range(warmup + repeats):\n"),
            "warm-up calls are timed too"),
        Mistake(_THREADS_DOC + _THREADS_BODY.replace("statistics.median(times)", "min(times)"),
                "a figure that one call decides"),
        Mistake(_THREADS_DOC + _THREADS_BODY.replace("time.perf_counter()", "time.process_time()"),
                "follows the order of the counts"),
        Mistake(_THREADS_DOC + _THREADS_BODY.replace("        torch.set_num_threads(before)\n",
                                                     "        torch.set_num_threads(counts[0])\n"),
                "it used 3 before the call"),
        Mistake(_THREADS_DOC + _THREADS_BODY.replace(
            "    before = torch.get_num_threads()\n    medians = {}\n    try:\n        for n in counts:\n",
            "    medians = {}\n    try:\n        for n in counts:\n            before = torch.get_num_threads()\n"),
            "read torch.get_num_threads() at the start"),
        Mistake(_THREADS_DOC.replace("counts=(1, 2), warmup=2, repeats=5", "counts=(1, 2), repeats=5, warmup=2")
                + _THREADS_BODY, "the signature must stay"),
        Mistake(_THREADS_DOC + _THREADS_BODY.replace(
            "            torch.set_num_threads(n)\n            for _ in range(warmup):\n                step()\n",
            "            for _ in range(warmup):\n                step()\n            torch.set_num_threads(n)\n"),
            "before the warm-up calls"),
        Mistake("medians = {}\n\n\n" + _THREADS_DOC + _THREADS_BODY.replace("    medians = {}\n", ""),
                "the medians outlive the call"),
        Mistake(_THREADS_DOC + _THREADS_BODY
                .replace("            for _ in range(warmup):\n                step()\n", "")
                .replace("    try:\n        for n in counts:\n",
                         "    for _ in range(warmup):\n        step()\n    try:\n        for n in counts:\n"),
                "set the count before the warm-up calls"),
    ],
))
