"""Exercises of notebook 01, "Callable objects".

01.1 a callable class (special methods are looked up on the type), 01.2 state kept on the instance,
01.3 the same state in a closure, 01.4 `functools.partial`, 01.5 a warm-up + cosine learning-rate
schedule as a callable class, checked against PyTorch's own `LinearLR` + `CosineAnnealingLR`.
"""
from __future__ import annotations

import functools
import math
import numbers
import re
import warnings

import torch

from ..i18n import N_, _
from .core import Exercise, Incorrect, Mistake, as_float, call, describe, real_item, register
from .probe import hold, observe


# --- shared helpers ---------------------------------------------------------------------------

def _require_class(answer, name: str) -> None:
    if not isinstance(answer, type):
        raise Incorrect(_("{name} should be a class (written with `class {name}:`), got {value}").format(
            name=name, value=describe(answer)))


def _as_float(value, label: str) -> float:
    """A real number (int, float, or a 0-d tensor) as a float; anything else is feedback."""
    value = real_item(value)
    if as_float(value) is None:  # not a real number, or an int no float can hold
        raise Incorrect(_("{label} should return a number, got {value}").format(label=label, value=describe(value)))
    return as_float(value)


def _close(a: float, b: float, tol: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)


# --- 01.1 a callable class --------------------------------------------------------------------

def _check_scale(Scale):
    # Every use of the learner's code goes through observe() (plain data back) or hold() (the object, for later
    # observe() calls only): the grader judges from the record of these, in a process where no learner code runs.
    observe(lambda: _require_class(Scale, "Scale"))
    s = hold(lambda: call(Scale, 3, name="Scale"))
    if not observe(lambda: callable(s)):
        if observe(lambda: "__call__" in getattr(s, "__dict__", {})):
            raise Incorrect(_("Scale(3) has an instance attribute named __call__, yet callable(Scale(3)) is False: "
                              "likely mistake: special methods are looked up on the type, not on the instance; "
                              "define `def __call__(self, x):` in the class body"))
        raise Incorrect(_("Scale(3) is not callable: define a method `__call__(self, x)` in the class body"))
    out = observe(lambda: call(s, 2, name="Scale(3)"))
    if out is None:
        raise Incorrect(_("Scale(3)(2) returned None: likely mistake: printing the result instead of returning it"))
    value = _as_float(out, "Scale(3)(2)")
    if value == 2:
        raise Incorrect(_("Scale(3)(2) returned 2, its input unchanged: likely mistake: the factor is ignored "
                          "(use self.factor)"))
    if value != 6:
        raise Incorrect(_("Scale(3)(2) should be 6, got {value!r}").format(value=out))
    half = observe(lambda: call(call(Scale, 0.5, name="Scale"), 4, name="Scale(0.5)"))
    half_value = _as_float(half, "Scale(0.5)(4)")
    if half_value == 12.0:
        raise Incorrect(_("Scale(0.5)(4) returned 12, that is 4 * 3: likely mistake: the factor 3 is written in "
                          "__call__; multiply by self.factor, the factor this instance was created with"))
    again = _as_float(observe(lambda: call(s, 2, name="Scale(3)")), "Scale(3)(2)")
    if again != 6:
        raise Incorrect(_("Scale(3)(2) returned 6 at first, but {value!r} once Scale(0.5) had been created: likely "
                          "mistake: the factor is kept on the class (Scale.factor = factor), which every instance "
                          "shares; keep it on the instance (self.factor = factor)").format(value=again))
    if half_value != 2.0:
        raise Incorrect(_("Scale(0.5)(4) should be 2.0, got {value!r}: is the factor stored per instance?").format(
            value=half))
    t = torch.tensor([1.0, -2.0])
    out_t = observe(lambda: call(s, t, name="Scale(3)"))
    if not isinstance(out_t, torch.Tensor) or not torch.equal(out_t, t * 3):
        raise Incorrect(_("Scale(3)(tensor([1., -2.])) should be tensor([3., -6.]), got {value}").format(
            value=describe(out_t)))
    return _("Scale(3)(x) runs type(s).__call__(s, x), and works on numbers and tensors alike")


_SCALE_HEAD = ("class Scale:\n"
               "    \"\"\"Multiply whatever it is called with by `factor`.\"\"\"\n\n"
               "    def __init__(self, factor):\n"
               "        self.factor = factor\n")

register(Exercise(
    id="01.1", title=N_("A callable class"), answer="Scale",
    blank=_SCALE_HEAD + "\n    def __call__(self, x):\n        raise NotImplementedError  # your code here\n",
    solution=_SCALE_HEAD + "\n    def __call__(self, x):\n        return x * self.factor\n",
    checker=_check_scale,
    hints=[N_("Python turns `s(x)` into `type(s).__call__(s, x)`: the method must be defined in the class body."),
           N_("Inside __call__, the factor given to __init__ is available as `self.factor`.")],
    mistakes=[
        Mistake("class Scale:\n    def __init__(self, factor):\n        self.factor = factor\n"
                "        self.__call__ = lambda x: x * factor\n", "looked up on the type"),
        Mistake(_SCALE_HEAD + "\n    def __call__(self, x):\n        return x\n", "factor is ignored"),
        Mistake(_SCALE_HEAD + "\n    def __call__(self, x):\n        print(x * self.factor)\n",
                "printing the result instead of returning it"),
        # in place: fine for a number, but it changes the caller's tensor
        Mistake(_SCALE_HEAD + "\n    def __call__(self, x):\n        x *= self.factor\n        return x\n",
                "changed its argument 1"),
        Mistake("class Scale:\n    def __init__(self, factor):\n        Scale.factor = factor\n\n"
                "    def __call__(self, x):\n        return x * self.factor\n", "kept on the class"),
        Mistake(_SCALE_HEAD + "\n    def __call__(self, x):\n        return x * 3\n", "the factor 3 is written"),
    ],
))


# --- 01.2 state on the instance ---------------------------------------------------------------

def _halving(outs: list[float], xs: tuple) -> bool:
    """Did each call return (previous result + x) / 2, a mean of means?"""
    return len(outs) == len(xs) and _close(outs[0], xs[0]) and all(
        _close(outs[i], (outs[i - 1] + xs[i]) / 2) for i in range(1, len(xs)))


def _stores_globals(fn) -> bool:
    """Does the function (or method) assign to global variables?"""
    import dis

    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return code is not None and any(ins.opname == "STORE_GLOBAL" for ins in dis.get_instructions(code))


def _check_fraction(outs: list[float], what: str) -> None:
    """`what` called with 1, then 2 returned `outs`: the mean of 1 and 2 is 1.5, not a whole number."""
    if all(_close(a, b) for a, b in zip(outs, [1.0, 1.5])):
        return
    if all(_close(a, b) for a, b in zip(outs, [1.0, 1.0])):
        raise Incorrect(_("{what} called with 1, then 2 returned {values}, not 1, 1.5: likely mistake: floor division "
                          "(total // count) drops the fraction; divide with /").format(what=what, values=outs))
    raise Incorrect(_("{what} called with 1, then 2 should return 1, 1.5 (the mean so far), got {values}").format(
        what=what, values=outs))


def _check_running_mean_class(RunningMean):
    observe(lambda: _require_class(RunningMean, "RunningMean"))
    m = hold(lambda: call(RunningMean, name="RunningMean"))
    if not observe(lambda: callable(m)):
        raise Incorrect(_("RunningMean() is not callable: define `__call__(self, x)` in the class body"))
    outs = [_as_float(observe(lambda: call(m, x, name="running_mean")), f"running_mean({x})") for x in (2, 4, 9)]
    if outs == [2.0, 4.0, 9.0]:
        raise Incorrect(_("the calls with 2, 4, 9 returned 2, 4, 9 (each latest value): likely mistake: the state "
                          "is reset inside __call__ instead of kept on self between calls"))
    if all(_close(a, b) for a, b in zip(outs, [2.0, 6.0, 15.0])):
        raise Incorrect(_("the calls with 2, 4, 9 returned 2, 6, 15, the running total: likely mistake: self.count "
                          "is never increased, so the total is divided by 1 (or not at all)"))
    if all(_close(a, b) for a, b in zip(outs[1:], [2.0, 3.0])):
        raise Incorrect(_("the calls with 2, 4, 9 returned {values}: each call returns the mean before x was added: "
                          "likely mistake: the mean is computed before self.total and self.count are updated").format(
                              values=outs))
    if _halving(outs, (2, 4, 9)):
        raise Incorrect(_("the calls with 2, 4, 9 returned {values}: likely mistake: each number is averaged with the "
                          "previous mean, (mean + x) / 2, which weighs the latest number as much as all the earlier "
                          "ones together; keep the total and the count, and return total / count").format(values=outs))
    if not all(_close(a, b) for a, b in zip(outs, [2.0, 3.0, 5.0])):
        raise Incorrect(_("calling with 2, then 4, then 9 should return 2, 3, 5 (the mean so far), got {values}").format(
            values=outs))
    fresh = _as_float(observe(lambda: call(call(RunningMean, name="RunningMean"), 10, name="running_mean")),
                      "running_mean(10)")
    if not _close(fresh, 10.0):
        if observe(lambda: _stores_globals(getattr(RunningMean, "__call__", None))):
            raise Incorrect(_("a new RunningMean() called with 10 returned {value}, not 10: likely mistake: the state "
                              "is kept in global variables, which every instance shares; keep it on self "
                              "(self.total, self.count)").format(value=fresh))
        raise Incorrect(_("a new RunningMean() called with 10 returned {value}, not 10: likely mistake: the state "
                          "lives on the class (shared by every instance) instead of on self").format(value=fresh))
    other = hold(lambda: call(RunningMean, name="RunningMean"))
    _check_fraction([_as_float(observe(lambda: call(other, x, name="running_mean")), f"running_mean({x})")
                     for x in (1, 2)], _("a new RunningMean()"))
    return _("each instance keeps its own total and count between calls")


_RM_HEAD = ("class RunningMean:\n"
            "    \"\"\"Each call adds a number and returns the mean of all the numbers seen so far.\"\"\"\n\n"
            "    def __init__(self):\n"
            "        self.total = 0.0\n"
            "        self.count = 0\n")

register(Exercise(
    id="01.2", title=N_("State kept on the instance"), answer="RunningMean",
    blank=_RM_HEAD + "\n    def __call__(self, x):\n        raise NotImplementedError  # your code here\n",
    solution=_RM_HEAD + ("\n    def __call__(self, x):\n        self.total += x\n        self.count += 1\n"
                         "        return self.total / self.count\n"),
    checker=_check_running_mean_class,
    hints=[N_("Update self.total and self.count, then return their ratio."),
           N_("Do not assign 0 to them inside __call__: __init__ runs once, __call__ runs on every call.")],
    mistakes=[
        Mistake(_RM_HEAD + ("\n    def __call__(self, x):\n        self.total, self.count = 0.0, 0\n"
                            "        self.total += x\n        self.count += 1\n"
                            "        return self.total / self.count\n"), "state is reset inside __call__"),
        Mistake("class RunningMean:\n    total = 0.0\n    count = 0\n\n    def __call__(self, x):\n"
                "        RunningMean.total += x\n        RunningMean.count += 1\n"
                "        return RunningMean.total / RunningMean.count\n", "lives on the class"),
        Mistake(_RM_HEAD + "\n    def __call__(self, x):\n        self.total += x\n        return self.total / max(self.count, 1)\n",
                "self.count is never increased"),
        Mistake(_RM_HEAD + ("\n    def __call__(self, x):\n        mean = self.total / self.count if self.count else x\n"
                            "        self.total += x\n        self.count += 1\n        return mean\n"),
                "computed before self.total and self.count are updated"),
        Mistake(_RM_HEAD + ("\n    def __call__(self, x):\n        self.total += x\n        self.count += 1\n"
                            "        return self.total // self.count\n"), "floor division"),
        Mistake(_RM_HEAD + ("\n    def __call__(self, x):\n        if self.count == 0:\n            self.mean = x\n"
                            "        else:\n            self.mean = (self.mean + x) / 2\n        self.count += 1\n"
                            "        return self.mean\n"), "averaged with the previous mean"),
        Mistake("total = 0.0\ncount = 0\n\n\nclass RunningMean:\n    def __call__(self, x):\n"
                "        global total, count\n        total += x\n        count += 1\n        return total / count\n",
                "kept in global variables"),
    ],
))


# --- 01.3 the same state in a closure ---------------------------------------------------------

def _check_make_running_mean(make_running_mean):
    if observe(lambda: isinstance(make_running_mean, type) or not callable(make_running_mean)):
        raise Incorrect(_("make_running_mean should be a function (written with `def make_running_mean():`), "
                          "got {value}").format(value=observe(lambda: describe(make_running_mean))))
    try:
        running_mean = hold(lambda: call(make_running_mean, name="make_running_mean"))
    except Incorrect as exc:
        if "required positional argument" in str(exc):
            raise Incorrect(_("{error}: likely mistake: make_running_mean() should return the inner function, "
                              "not call it").format(error=exc)) from None
        raise
    if not observe(lambda: callable(running_mean)):
        raise Incorrect(_("make_running_mean() should return a function, got {value}").format(
            value=observe(lambda: describe(running_mean))))
    outs = []
    for x in (2, 4, 9):
        try:
            outs.append(_as_float(observe(lambda: call(running_mean, x, name="running_mean")), f"running_mean({x})"))
        except Incorrect as exc:
            if "UnboundLocalError" in str(exc):
                raise Incorrect(_("{error}: likely mistake: assigning to a variable inside the inner function "
                                  "makes it local to that function; declare the outer variables `nonlocal`").format(
                                      error=exc)) from None
            raise
    if outs == [2.0, 4.0, 9.0]:
        raise Incorrect(_("the calls with 2, 4, 9 returned 2, 4, 9 (each latest value): likely mistake: the state "
                          "is reset inside the inner function; create it once, in make_running_mean"))
    if not all(_close(a, b) for a, b in zip(outs, [2.0, 3.0, 5.0])):
        raise Incorrect(_("calling with 2, then 4, then 9 should return 2, 3, 5 (the mean so far), got {values}").format(
            values=outs))
    other = hold(lambda: call(make_running_mean, name="make_running_mean"))
    fresh = _as_float(observe(lambda: call(other, 10, name="running_mean")), "running_mean(10)")
    if not _close(fresh, 10.0):
        shared = observe(lambda: any(isinstance(d, (list, dict))
                                     for d in (getattr(make_running_mean, "__defaults__", None) or ())))
        if shared:
            raise Incorrect(_("a second make_running_mean() called with 10 returned {value}, not 10: likely mistake: "
                              "a default argument such as values=[] is created once, when `def` runs, and every call "
                              "of make_running_mean gets that same list; create the state inside "
                              "make_running_mean").format(value=fresh))
        raise Incorrect(_("a second make_running_mean() called with 10 returned {value}, not 10: each closure "
                          "should have its own state (global variables are shared)").format(value=fresh))
    third = hold(lambda: call(make_running_mean, name="make_running_mean"))
    _check_fraction([_as_float(observe(lambda: call(third, x, name="running_mean")), f"running_mean({x})")
                     for x in (1, 2)], _("a new make_running_mean()"))
    return _("the closure's cells hold the state that an instance would keep in attributes")


register(Exercise(
    id="01.3", title=N_("The same state in a closure"), answer="make_running_mean",
    blank="def make_running_mean():\n    raise NotImplementedError  # your code here\n",
    solution=("def make_running_mean():\n    total, count = 0.0, 0\n\n    def running_mean(x):\n"
              "        nonlocal total, count\n        total += x\n        count += 1\n"
              "        return total / count\n\n    return running_mean\n"),
    checker=_check_make_running_mean,
    hints=[N_("Create total and count in make_running_mean, define an inner function that updates them, and "
              "return the inner function (without calling it)."),
           N_("`total += x` inside the inner function assigns to `total`, which makes it local there unless you "
              "write `nonlocal total, count` first.")],
    mistakes=[
        Mistake("def make_running_mean():\n    total, count = 0.0, 0\n\n    def running_mean(x):\n"
                "        total += x\n        count += 1\n        return total / count\n\n"
                "    return running_mean\n", "nonlocal"),
        Mistake("def make_running_mean():\n    def running_mean(x):\n        total, count = 0.0, 0\n"
                "        total += x\n        count += 1\n        return total / count\n\n"
                "    return running_mean\n", "state is reset inside the inner function"),
        Mistake("def make_running_mean():\n    total, count = 0.0, 0\n\n    def running_mean(x):\n"
                "        nonlocal total, count\n        total += x\n        count += 1\n"
                "        return total / count\n\n    return running_mean()\n", "not call it"),
        Mistake("def make_running_mean():\n    total, count = 0.0, 0\n\n    def running_mean(x):\n"
                "        nonlocal total, count\n        total += x\n        count += 1\n"
                "        return total // count\n\n    return running_mean\n", "floor division"),
        Mistake("def make_running_mean(values=[]):\n    def running_mean(x):\n        values.append(x)\n"
                "        return sum(values) / len(values)\n\n    return running_mean\n", "a default argument"),
        Mistake("total, count = 0.0, 0\n\n\ndef make_running_mean():\n    def running_mean(x):\n"
                "        global total, count\n        total += x\n        count += 1\n        return total / count\n\n"
                "    return running_mean\n", "global variables are shared"),
    ],
))


# --- 01.4 functools.partial -------------------------------------------------------------------

def _cosine(epoch: float, base_lr: float, min_lr: float, total_epochs: int) -> float:
    """The notebook's `cosine_lr`, the checker's own copy."""
    if epoch >= total_epochs:
        return min_lr
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * epoch / total_epochs))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _describe_function(value) -> str:
    """describe(value) without the memory address in a function's repr: it tells the learner nothing, and it differs
    from one run of the same code to the next."""
    return _ADDRESS.sub("", describe(value))


def _check_partial(schedule):
    if observe(lambda: isinstance(schedule, numbers.Real)):
        raise Incorrect(_("schedule is the number {value!r}: likely mistake: you called cosine_lr once; "
                          "partial(cosine_lr, ...) returns a new callable without calling it").format(
                              value=observe(lambda: schedule)))
    if not observe(lambda: isinstance(schedule, functools.partial)):
        if observe(lambda: callable(schedule)):
            raise Incorrect(_("schedule is callable but not a functools.partial ({value}): the point "
                              "of this exercise is `partial(cosine_lr, base_lr=..., ...)`").format(
                                  value=observe(lambda: _describe_function(schedule))))
        raise Incorrect(_("schedule should be partial(cosine_lr, ...), got {value}").format(
            value=observe(lambda: describe(schedule))))
    if observe(lambda: getattr(schedule.func, "__name__", None)) != "cosine_lr":
        raise Incorrect(_("schedule wraps {value}; it should wrap cosine_lr").format(
            value=observe(lambda: _describe_function(schedule.func))))
    args = observe(lambda: tuple(schedule.args))
    if args:
        raise Incorrect(_("schedule fixes the positional arguments {args!r}: likely mistake: positional "
                          "arguments to partial fill the *first* parameters (epoch comes first here); give "
                          "base_lr=..., min_lr=..., total_epochs=... by keyword").format(args=args))
    keywords = observe(lambda: dict(schedule.keywords))
    if "epoch" in keywords:
        raise Incorrect(_("schedule also fixes epoch={value!r}: then schedule(epoch) passes epoch a second time "
                          "(TypeError: multiple values for argument 'epoch'); leave epoch free and freeze only "
                          "base_lr, min_lr and total_epochs").format(value=keywords["epoch"]))
    expected = {"base_lr": 0.1, "min_lr": 0.001, "total_epochs": 20}
    got = {k: keywords.get(k) for k in expected}
    if got != expected:
        raise Incorrect(_("schedule fixes {keywords!r}; it should fix base_lr=0.1, min_lr=0.001 "
                          "and total_epochs=20").format(keywords=keywords))
    for epoch in (0, 5, 10, 19, 20, 25):
        value = _as_float(observe(lambda: call(schedule, epoch, name="schedule")), f"schedule({epoch})")
        if not _close(value, _cosine(epoch, **expected)):
            raise Incorrect(_("schedule({epoch}) returned {value}, expected {expected}").format(
                epoch=epoch, value=value, expected=_cosine(epoch, **expected)))
    return _("schedule.func, schedule.keywords show exactly what was frozen")


_COSINE_FN = ("import math\nfrom functools import partial\n\n"
              "def cosine_lr(epoch, base_lr, min_lr, total_epochs):\n"
              "    if epoch >= total_epochs:\n"
              "        return min_lr\n"
              "    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * epoch / total_epochs))\n")

register(Exercise(
    id="01.4", title=N_("Freezing arguments with functools.partial"), answer="schedule",
    blank="schedule = ...\n",
    solution="schedule = partial(cosine_lr, base_lr=0.1, min_lr=0.001, total_epochs=20)\n",
    setup=_COSINE_FN,
    checker=_check_partial,
    hints=[N_("partial(f, name=value) returns a callable that calls f with name=value added."),
           N_("epoch is cosine_lr's first parameter: freeze the other three by keyword so that schedule(epoch) "
              "still fills epoch.")],
    mistakes=[
        Mistake("schedule = partial(cosine_lr, 0.1, 0.001, 20)\n", "positional arguments to partial fill"),
        Mistake("schedule = cosine_lr(0, base_lr=0.1, min_lr=0.001, total_epochs=20)\n", "without calling it"),
        Mistake("schedule = partial(cosine_lr, base_lr=0.1, min_lr=0.001, total_epochs=10)\n",
                "total_epochs=20"),
        Mistake("schedule = partial(cosine_lr, epoch=0, base_lr=0.1, min_lr=0.001, total_epochs=20)\n",
                "leave epoch free"),
        Mistake("schedule = partial(cosine_lr, base_lr=0.001, min_lr=0.1, total_epochs=20)\n",
                "it should fix base_lr=0.1, min_lr=0.001"),
        Mistake("schedule = lambda epoch: cosine_lr(epoch, 0.1, 0.001, 20)\n", "not a functools.partial"),
    ],
))


# --- 01.5 warm-up + cosine as a callable class -------------------------------------------------

def _torch_warmup_cosine(base_lr: float, min_lr: float, warmup: int, total: int, epochs: int) -> list[float]:
    """The learning rate of each epoch under PyTorch's LinearLR warm-up followed by CosineAnnealingLR."""
    from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=base_lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "optimizer.step() before lr_scheduler.step()": no training here
        sched = SequentialLR(opt, [LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1),
                                   CosineAnnealingLR(opt, T_max=total - warmup, eta_min=min_lr)],
                             milestones=[warmup])
        lrs = []
        for _epoch in range(epochs):
            lrs.append(opt.param_groups[0]["lr"])
            sched.step()
    return lrs


def _check_warmup_cosine(WarmupCosine):
    observe(lambda: _require_class(WarmupCosine, "WarmupCosine"))
    for base_lr, min_lr, warmup, total in ((0.1, 0.001, 5, 30), (1.0, 0.05, 3, 10)):
        label = f"WarmupCosine({base_lr}, {min_lr}, {warmup}, {total})"
        sched = hold(lambda: call(WarmupCosine, base_lr, min_lr, warmup, total, name="WarmupCosine"))
        if not observe(lambda: callable(sched)):
            raise Incorrect(_("{label} is not callable: define `__call__(self, epoch)` in the class body").format(
                label=label))
        reference = _torch_warmup_cosine(base_lr, min_lr, warmup, total, total)
        got = [_as_float(observe(lambda: call(sched, e, name=label)), f"{label}({e})") for e in range(total + 6)]
        if _close(got[0], 0.0):
            raise Incorrect(_("{label}(0) is 0: likely mistake: the warm-up starts at zero, so the first epoch "
                              "does not train; use base_lr * (epoch + 1) / warmup_epochs").format(label=label))
        for e in range(warmup):
            if not _close(got[e], reference[e]):
                raise Incorrect(_("warm-up: {label}({epoch}) returned {value:.6g}, expected {expected:.6g} "
                                  "(base_lr * (epoch + 1) / warmup_epochs)").format(
                                      label=label, epoch=e, value=got[e], expected=reference[e]))
        if not _close(got[warmup], base_lr) and _close(got[warmup], base_lr * (warmup + 1) / warmup):
            raise Incorrect(_("{label}({epoch}) returned {value:.6g}, base_lr * (epoch + 1) / warmup_epochs: likely "
                              "mistake: the warm-up runs one epoch too long (epoch <= warmup_epochs); it covers epochs "
                              "0 to warmup_epochs - 1, and at epoch warmup_epochs the cosine starts, at base_lr = "
                              "{base_lr}").format(label=label, epoch=warmup, value=got[warmup], base_lr=base_lr))
        if not _close(got[warmup], base_lr):
            raise Incorrect(_("{label}({epoch}) returned {value:.6g}, expected base_lr = {base_lr}: likely "
                              "mistake: the cosine should start at the end of the warm-up, "
                              "progress = (epoch - warmup_epochs) / (total_epochs - warmup_epochs)").format(
                                  label=label, epoch=warmup, value=got[warmup], base_lr=base_lr))
        for e in range(warmup, total):
            if not _close(got[e], reference[e]):
                without_min = (reference[e] - min_lr) * base_lr / (base_lr - min_lr)  # the cosine from base_lr to 0
                if _close(got[e], without_min):
                    raise Incorrect(_("{label}({epoch}) returned {value:.6g}, expected {expected:.6g}: likely "
                                      "mistake: the cosine ends at 0 instead of min_lr (add min_lr and scale by "
                                      "base_lr - min_lr)").format(label=label, epoch=e, value=got[e],
                                                                  expected=reference[e]))
                over_total = min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * (e - warmup) / total))
                if _close(got[e], over_total):
                    raise Incorrect(_("{label}({epoch}) returned {value:.6g}, expected {expected:.6g}: likely "
                                      "mistake: the progress is divided by total_epochs, so the cosine has not "
                                      "reached min_lr at total_epochs; it runs over the total_epochs - "
                                      "warmup_epochs epochs after the warm-up: progress = (epoch - warmup_epochs) / "
                                      "(total_epochs - warmup_epochs)").format(label=label, epoch=e, value=got[e],
                                                                               expected=reference[e]))
                raise Incorrect(_("{label}({epoch}) returned {value:.6g}, expected {expected:.6g} "
                                  "(PyTorch's LinearLR + CosineAnnealingLR give that value)").format(
                                      label=label, epoch=e, value=got[e], expected=reference[e]))
        late = got[total:]
        if not all(_close(v, min_lr) for v in late):
            raise Incorrect(_("{label} after total_epochs returned {values}: likely mistake: the cosine goes back "
                              "up; the schedule should stay at min_lr from total_epochs on").format(
                                  label=label, values=[round(v, 6) for v in late]))
        # A fresh schedule asked for epochs out of order: the rate depends on `epoch`, not on the calls before.
        order = [warmup + 1, 0, total + 2, warmup + 1, warmup - 1]
        fresh = hold(lambda: call(WarmupCosine, base_lr, min_lr, warmup, total, name="WarmupCosine"))
        shuffled = [_as_float(observe(lambda: call(fresh, e, name=label)), f"{label}({e})") for e in order]
        expected = [got[e] for e in order]
        if not all(_close(a, b) for a, b in zip(shuffled, expected)):
            raise Incorrect(_("a new {label} called with the epochs {order} returned {values}, expected {expected}: "
                              "likely mistake: the rate depends on the earlier calls (a counter or a rate kept on "
                              "self and updated at each call) instead of on `epoch` alone; a schedule may be asked "
                              "for any epoch, in any order (resuming from a checkpoint starts in the middle)").format(
                label=label, order=order, values=[round(v, 6) for v in shuffled],
                expected=[round(v, 6) for v in expected]))
    return _("it matches PyTorch's LinearLR + CosineAnnealingLR (SequentialLR) epoch by epoch")


_WC_HEAD = ("class WarmupCosine:\n"
            "    \"\"\"Linear warm-up for `warmup_epochs`, then cosine annealing to `min_lr` at `total_epochs`.\"\"\"\n\n"
            "    def __init__(self, base_lr, min_lr, warmup_epochs, total_epochs):\n"
            "        self.base_lr, self.min_lr = base_lr, min_lr\n"
            "        self.warmup_epochs, self.total_epochs = warmup_epochs, total_epochs\n")
_WC_SOLUTION = (
    "\n    def __call__(self, epoch):\n"
    "        if epoch < self.warmup_epochs:\n"
    "            return self.base_lr * (epoch + 1) / self.warmup_epochs\n"
    "        if epoch >= self.total_epochs:\n"
    "            return self.min_lr\n"
    "        progress = (epoch - self.warmup_epochs) / (self.total_epochs - self.warmup_epochs)\n"
    "        return self.min_lr + 0.5 * (self.base_lr - self.min_lr) * (1 + math.cos(math.pi * progress))\n")

register(Exercise(
    id="01.5", title=N_("Warm-up, then cosine: a schedule as a callable class"), answer="WarmupCosine",
    blank=_WC_HEAD + "\n    def __call__(self, epoch):\n        raise NotImplementedError  # your code here\n",
    solution=_WC_HEAD + _WC_SOLUTION,
    setup="import math\n",
    checker=_check_warmup_cosine,
    hints=[N_("Three cases: epoch < warmup_epochs (linear rise), epoch >= total_epochs (min_lr), and the cosine "
              "in between."),
           N_("The cosine part is CosineSchedule's formula with the epochs counted from the end of the warm-up: "
              "progress = (epoch - warmup_epochs) / (total_epochs - warmup_epochs).")],
    mistakes=[
        Mistake(_WC_HEAD + _WC_SOLUTION.replace("(epoch + 1) / self.warmup_epochs", "epoch / self.warmup_epochs"),
                "warm-up starts at zero"),
        Mistake(_WC_HEAD + _WC_SOLUTION.replace(
            "(epoch - self.warmup_epochs) / (self.total_epochs - self.warmup_epochs)", "epoch / self.total_epochs"),
            "start at the end of the warm-up"),
        Mistake(_WC_HEAD + _WC_SOLUTION.replace(
            "        if epoch >= self.total_epochs:\n            return self.min_lr\n", ""), "stay at min_lr"),
        Mistake(_WC_HEAD + _WC_SOLUTION.replace("self.min_lr + 0.5 * (self.base_lr - self.min_lr)",
                                                "0.5 * self.base_lr"), "ends at 0 instead of min_lr"),
        Mistake(_WC_HEAD + _WC_SOLUTION.replace("if epoch < self.warmup_epochs:", "if epoch <= self.warmup_epochs:"),
                "one epoch too long"),
        Mistake(_WC_HEAD + "        self.calls = 0\n" + _WC_SOLUTION.replace(
            "    def __call__(self, epoch):\n",
            "    def __call__(self, epoch):\n        epoch = self.calls  # the epoch this call stands for\n"
            "        self.calls += 1\n"), "depends on the earlier calls"),
        Mistake(_WC_HEAD + _WC_SOLUTION.replace(
            "(epoch - self.warmup_epochs) / (self.total_epochs - self.warmup_epochs)",
            "(epoch - self.warmup_epochs) / self.total_epochs"), "divided by total_epochs"),
    ],
))
