"""Exercises of notebook 05, "Memory and out-of-memory recovery".

05.1 predict the bytes of parameters, gradients and optimizer state (claim 6), checked against what a
`SimulatedGPU` counts during a real training step; 05.2 read a CUDA out-of-memory message: fragmentation,
other processes, or a step that is simply too big; 05.3 a training step that survives the OOM (the retry
runs after the `except` block), checked on a `SimulatedGPU` against the full-batch update; 05.4 find the
leak that keeps memory high after recovery; 05.5 the Trainer's memory check (will the first step fit?) in one
function; 05.6 the largest batch that fits, from a memory model that is affine in the batch size; 05.7 a
gradient-accumulation loop whose last, shorter group still counts (claim 12).

Checkers build their models under a private random state (`torch.random.fork_rng`), run on the CPU only
and never leave a `SimulatedGPU` active, so a check leaves the notebook's state as it was.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..i18n import N_, _
from ..memory import SimulatedGPU, format_bytes
from .core import (AnswerTimeout, Exercise, Incorrect, Mistake, _short, as_float, call, describe, register, require_function,
                   seeded)
from .probe import observe


def _mlp(width: int = 64, depth: int = 3, inputs: int = 32, seed: int = 0) -> nn.Sequential:
    """A small ReLU MLP (inputs -> width x depth -> 10) without BatchNorm: micro-batches give the same update."""
    with seeded(seed):
        layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
        for _layer in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, 10))
        return nn.Sequential(*layers)


def _data(n: int, inputs: int = 32, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    with seeded(seed):
        return torch.randn(n, inputs), torch.randint(0, 10, (n,))


def _clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def _values(model: nn.Module) -> list[torch.Tensor]:
    """Copies of the parameters' values: what the checker compares."""
    return [p.detach().clone() for p in model.parameters()]


def _same_parameters(a: list[torch.Tensor], b: list[torch.Tensor], rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """Two lists of parameter values (see `_values`) agree."""
    return len(a) == len(b) and all(torch.allclose(p, q, rtol=rtol, atol=atol) for p, q in zip(a, b))


def _require_function(answer, name: str) -> None:
    """require_function, for observe(): nothing of the answer comes back."""
    require_function(answer, name)


# --- 05.1 parameters, gradients and optimizer state --------------------------------------------------

_OPTIMIZERS: dict[str, Callable] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
}


class _TinyCNN(nn.Module):
    """Two convolutions and a classifier; `frozen=True` freezes the convolutions (fine-tuning a head)."""

    def __init__(self, frozen: bool = False):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(16 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, 10))
        if frozen:
            self.features.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _state_cases() -> list[tuple[str, Callable[[], nn.Module], tuple[int, ...], torch.dtype]]:
    return [(N_("a 3-layer MLP"), lambda: _mlp(width=48), (32,), torch.float32),
            (N_("a small CNN"), lambda: _TinyCNN(), (1, 28, 28), torch.float32),
            (N_("the same CNN with its convolutions frozen (requires_grad=False)"), lambda: _TinyCNN(frozen=True),
             (1, 28, 28), torch.float32),
            # pure 16-bit training: 2 bytes per value, and the optimizer state in the parameters' dtype
            (N_("the 3-layer MLP in bfloat16"), lambda: _mlp(width=48).to(torch.bfloat16), (32,), torch.bfloat16)]


_MEASURED: dict[tuple[int, str], int] = {}


def _measured_state_bytes(case: int, opt_name: str) -> int:
    """Parameters + gradients + optimizer state after a real training step, counted byte for byte by a
    SimulatedGPU (block_bytes=1: no allocator rounding). Cached: the same for every check."""
    key = (case, opt_name)
    if key not in _MEASURED:
        _label, make, shape, dtype = _state_cases()[case]
        with seeded(5):
            model = make()
            opt = _OPTIMIZERS[opt_name](model.parameters())
            x, y = torch.rand(2, *shape, dtype=dtype), torch.randint(0, 10, (2,))
            with SimulatedGPU("1GiB", model=model, optimizer=opt, block_bytes=1) as gpu:
                F.cross_entropy(model(x), y).backward()
                opt.step()  # creates the optimizer state
                b = gpu.breakdown()
        _MEASURED[key] = b.parameters + b.gradients + b.optimizer_state
    return _MEASURED[key]


def _check_training_state_bytes(training_state_bytes):
    observe(lambda: _require_function(training_state_bytes, "training_state_bytes"))
    for case, (label, make, _shape, dtype) in enumerate(_state_cases()):
        for opt_name in _OPTIMIZERS:
            with seeded(5):
                model = make()
            # what the checker knows of its model, read before the answer gets it
            n_tensors = len(list(model.parameters()))
            every = sum(p.numel() * p.element_size() for p in model.parameters())
            trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
            got = observe(lambda: call(training_state_bytes, model, opt_name, name="training_state_bytes"))
            if as_float(got) is None or not math.isfinite(as_float(got)):
                raise Incorrect(_("training_state_bytes should return a number of bytes (an int), got {value}").format(
                    value=describe(got)))
            expected = _measured_state_bytes(case, opt_name)
            if abs(got - expected) <= 8 * n_tensors + 1e-3 * expected:  # Adam's 4-byte step counters
                continue
            shown = _("for {label} with {optimizer!r}: got {got:,.0f} bytes, but a real training step holds "
                      "{expected:,} bytes ({size}) of parameters, gradients and optimizer state").format(
                label=_(label), optimizer=opt_name, got=got, expected=expected, size=format_bytes(expected))
            close = lambda v: abs(got - v) <= 8 * n_tensors + 1e-3 * expected  # noqa: E731
            size = torch.empty((), dtype=dtype).element_size()
            if size != 4 and close(expected * 4 / size):
                raise Incorrect(_("{shown}: likely mistake: 4 bytes per value were assumed (float32), but this "
                                  "model's parameters are {dtype}, {size} bytes each: p.element_size() gives a "
                                  "tensor's bytes per value, and the gradients and optimizer state take the "
                                  "parameters' dtype").format(shown=shown, dtype=str(dtype).removeprefix("torch."),
                                                              size=size))
            buffers = {"sgd": 0, "momentum": 1, "adam": 2}[opt_name]
            if trainable < every and buffers and close(every + trainable + buffers * every):
                raise Incorrect(_("{shown}: likely mistake: optimizer state was counted for the frozen parameters "
                                  "too; the optimizer makes state only for parameters that get a gradient, so a "
                                  "frozen parameter costs only its own bytes").format(shown=shown))
            if opt_name == "momentum" and close(every + trainable):
                raise Incorrect(_("{shown}: likely mistake: SGD with momentum was counted like plain SGD; momentum "
                                  "keeps one buffer (momentum_buffer) per trained parameter, the size of the "
                                  "parameter").format(shown=shown))
            if opt_name == "adam" and close(every + 2 * trainable):
                raise Incorrect(_("{shown}: likely mistake: Adam keeps two buffers per parameter (exp_avg and "
                                  "exp_avg_sq), on top of the gradient").format(shown=shown))
            if close(3 * every):
                raise Incorrect(_("{shown}: likely mistake: the same x3 for every optimizer (the blog claim); it "
                                  "depends on the optimizer: plain SGD keeps no state (parameters + gradients), "
                                  "momentum one buffer per parameter, Adam two").format(shown=shown))
            if trainable < every and any(close(every * k) for k in (2, 3, 4)):
                raise Incorrect(_("{shown}: likely mistake: frozen parameters (requires_grad=False) were counted "
                                  "as trained: they get no gradient and no optimizer state, only their own "
                                  "bytes").format(shown=shown))
            if any(close(v * 8) for v in (expected, every * 2, every * 3, every * 4)):
                raise Incorrect(_("{shown}: likely mistake: counted bits, not bytes; element_size() is already in "
                                  "bytes (4 for float32)").format(shown=shown))
            raise Incorrect(shown)
    return _("SGD 2x, momentum 3x, Adam 4x the parameters' bytes, and frozen parameters only 1x")


_STATE_SIG = ("def training_state_bytes(model, optimizer_name):\n"
              "    \"\"\"Bytes of parameters + gradients + optimizer state while training `model` with optimizer_name\n"
              "    \"sgd\", \"momentum\" or \"adam\" (activations not included).\"\"\"\n")

register(Exercise(
    id="05.1", title=N_("Predict the memory of parameters, gradients and optimizer state"),
    answer="training_state_bytes",
    blank=_STATE_SIG + "    raise NotImplementedError  # your code here\n",
    solution=(_STATE_SIG
              + "    every = sum(p.numel() * p.element_size() for p in model.parameters())\n"
                "    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)\n"
                "    buffers = {\"sgd\": 0, \"momentum\": 1, \"adam\": 2}[optimizer_name]  # optimizer state per parameter\n"
                "    return every + trainable * (1 + buffers)  # + one gradient per trained parameter\n"),
    setup="import torch\n",
    checker=_check_training_state_bytes,
    hints=[N_("p.numel() * p.element_size() is a tensor's size in bytes. Every parameter is stored once; each "
              "trained parameter (p.requires_grad) also gets a gradient of the same size."),
           N_("Optimizer state per trained parameter: plain SGD none, SGD with momentum one buffer, Adam two "
              "(exp_avg and exp_avg_sq). Frozen parameters get neither gradient nor state.")],
    mistakes=[
        Mistake(_STATE_SIG + "    return 3 * sum(p.numel() * p.element_size() for p in model.parameters())\n",
                "the same x3 for every optimizer"),
        Mistake(_STATE_SIG + "    every = sum(p.numel() * p.element_size() for p in model.parameters())\n"
                "    return every * {\"sgd\": 2, \"momentum\": 3, \"adam\": 4}[optimizer_name]\n", "frozen parameters"),
        Mistake(_STATE_SIG + "    every = sum(p.numel() * 32 for p in model.parameters())\n"
                "    return every * {\"sgd\": 2, \"momentum\": 3, \"adam\": 4}[optimizer_name]\n", "bits, not bytes"),
        Mistake(_STATE_SIG + "    every = sum(p.numel() * 4 for p in model.parameters())  # 4 bytes per float\n"
                "    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)\n"
                "    return every + trainable * {\"sgd\": 1, \"momentum\": 2, \"adam\": 3}[optimizer_name]\n",
                "4 bytes per value were assumed"),
        Mistake(_STATE_SIG + "    every = sum(p.numel() * p.element_size() for p in model.parameters())\n"
                "    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)\n"
                "    buffers = {\"sgd\": 0, \"momentum\": 1, \"adam\": 2}[optimizer_name]\n"
                "    return every + trainable + every * buffers  # no gradient for frozen parameters\n",
                "optimizer state was counted for the frozen parameters"),
        Mistake(_STATE_SIG + "    every = sum(p.numel() * p.element_size() for p in model.parameters())\n"
                "    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)\n"
                "    buffers = {\"sgd\": 0, \"momentum\": 0, \"adam\": 2}[optimizer_name]  # momentum: still SGD\n"
                "    return every + trainable * (1 + buffers)\n",
                "counted like plain SGD"),
    ],
))


# --- 05.2 reading an out-of-memory message ------------------------------------------------------------

_MIB, _GIB = 2 ** 20, 2 ** 30
_DIAGNOSES = ("fragmentation", "other processes", "too big")


def _oom(requested, capacity, free, process, allocated, reserved_unallocated) -> dict:
    return {"requested": int(requested), "capacity": int(capacity), "free": int(free), "process": int(process),
            "allocated": int(allocated), "reserved_unallocated": int(reserved_unallocated)}


def _oom_cases() -> list[tuple[dict, str]]:
    return [
        # this process holds almost everything, in live tensors: the step is too big for the GPU
        (_oom(256 * _MIB, 15.77 * _GIB, 90 * _MIB, 15.6 * _GIB, 15.41 * _GIB, 110 * _MIB), "too big"),
        # plenty cached but unallocated, none of it in one piece: fragmentation
        (_oom(512 * _MIB, 23.65 * _GIB, 300 * _MIB, 23.2 * _GIB, 19.9 * _GIB, 3.1 * _GIB), "fragmentation"),
        # another notebook's kernel holds 9 GiB of the card
        (_oom(1 * _GIB, 23.65 * _GIB, 410 * _MIB, 14.1 * _GIB, 13.8 * _GIB, 200 * _MIB), "other processes"),
        # a single tensor bigger than the whole GPU
        (_oom(40 * _GIB, 23.65 * _GIB, 20.2 * _GIB, 3.3 * _GIB, 3.0 * _GIB, 120 * _MIB), "too big"),
        # a little fragmentation, but less than the request: still too big
        (_oom(2 * _GIB, 79.1 * _GIB, 1.1 * _GIB, 77.9 * _GIB, 76.6 * _GIB, 900 * _MIB), "too big"),
        # exactly the request reserved but unallocated: "at least" holds, fragmentation
        (_oom(1 * _GIB, 15.77 * _GIB, 200 * _MIB, 15.77 * _GIB - 300 * _MIB, 14.6 * _GIB, 1 * _GIB), "fragmentation"),
        # other processes hold exactly the request: "at least" holds
        (_oom(2 * _GIB, 79 * _GIB, 300 * _MIB, 79 * _GIB - 300 * _MIB - 2 * _GIB, 76.2 * _GIB, 400 * _MIB),
         "other processes"),
        # both hold: the first rule decides, fragmentation (PyTorch's own cached memory is the first fix)
        (_oom(2 * _GIB, 23.65 * _GIB, 150 * _MIB, 20.5 * _GIB, 17.9 * _GIB, 2.5 * _GIB), "fragmentation"),
    ]


def _check_diagnose(diagnose):
    observe(lambda: _require_function(diagnose, "diagnose"))
    for oom, expected in _oom_cases():
        got = observe(lambda: call(diagnose, dict(oom), name="diagnose", check_mutation=False))
        if not isinstance(got, str):
            raise Incorrect(_("diagnose should return one of {choices}, got {value}").format(
                choices=_DIAGNOSES, value=describe(got)))
        if got not in _DIAGNOSES:
            raise Incorrect(_("diagnose returned {got!r}; it should return one of {choices}").format(
                got=got, choices=_DIAGNOSES))
        if got == expected:
            continue
        shown = _("for an OOM with {numbers}: diagnose returned {got!r}, expected {expected!r}").format(
            numbers=", ".join(f"{k} {format_bytes(v)}" for k, v in oom.items()), got=got, expected=expected)
        others = oom["capacity"] - oom["free"] - oom["process"]
        if expected == "fragmentation" and oom["reserved_unallocated"] == oom["requested"]:
            raise Incorrect(_("{shown}: likely mistake: `>` instead of `>=`: the memory reserved but unallocated "
                              "({cached}) is exactly the request, and 'at least the request' includes "
                              "equality").format(shown=shown, cached=format_bytes(oom['reserved_unallocated'])))
        if expected == "other processes" and others == oom["requested"]:
            raise Incorrect(_("{shown}: likely mistake: `>` instead of `>=`: other processes hold capacity - free - "
                              "process = {others}, exactly the request, and 'at least the request' includes "
                              "equality").format(shown=shown, others=format_bytes(others)))
        if expected == "fragmentation" and got == "other processes" and others >= oom["requested"]:
            raise Incorrect(_("{shown}: likely mistake: the other processes were checked first; here both hold "
                              "(other processes {others}, reserved but unallocated {cached}), and the order given "
                              "decides: fragmentation first").format(
                shown=shown, others=format_bytes(others), cached=format_bytes(oom['reserved_unallocated'])))
        if expected == "fragmentation":
            raise Incorrect(_("{shown}: likely mistake: the 'reserved but unallocated' memory was ignored; PyTorch "
                              "holds {cached} of free cached memory, more than the request, yet could not use it: "
                              "no single free block is big enough").format(
                shown=shown, cached=format_bytes(oom['reserved_unallocated'])))
        if expected == "too big" and got == "other processes":
            raise Incorrect(_("{shown}: likely mistake: this process's own memory was counted as other "
                              "processes'; capacity - free includes what this process holds ({others} "
                              "is all the other processes have)").format(shown=shown, others=format_bytes(others)))
        if expected == "other processes":
            raise Incorrect(_("{shown}: other processes hold capacity - free - process = {others}, "
                              "more than the request: freeing them (another notebook's kernel?) would let it "
                              "fit").format(shown=shown, others=format_bytes(others)))
        raise Incorrect(shown)
    return _("fragmentation -> expandable_segments; other processes -> free the GPU; too big -> a smaller step")


_DIAG_SIG = ("def diagnose(oom):\n"
             "    \"\"\"\"fragmentation\", \"other processes\" or \"too big\" for the numbers (bytes) of a CUDA OOM message.\"\"\"\n")

register(Exercise(
    id="05.2", title=N_("Read an out-of-memory message"), answer="diagnose",
    blank=_DIAG_SIG + "    raise NotImplementedError  # your code here\n",
    solution=(_DIAG_SIG
              + "    if oom[\"reserved_unallocated\"] >= oom[\"requested\"]:\n"
                "        return \"fragmentation\"  # enough cached memory in total, but no free block big enough\n"
                "    others = oom[\"capacity\"] - oom[\"free\"] - oom[\"process\"]  # memory of other processes\n"
                "    if others >= oom[\"requested\"]:\n"
                "        return \"other processes\"\n"
                "    return \"too big\"\n"),
    setup="",
    checker=_check_diagnose,
    hints=[N_("Check in the order given: first compare the request with the memory PyTorch has reserved but not "
              "allocated, then with the memory other processes hold."),
           N_("Other processes hold capacity - free - process: the GPU's memory that is neither free nor this "
              "process's.")],
    mistakes=[
        Mistake(_DIAG_SIG + "    others = oom[\"capacity\"] - oom[\"free\"] - oom[\"process\"]\n"
                "    return \"other processes\" if others >= oom[\"requested\"] else \"too big\"\n",
                "reserved but unallocated"),
        Mistake(_DIAG_SIG + "    if oom[\"reserved_unallocated\"] >= oom[\"requested\"]:\n"
                "        return \"fragmentation\"\n"
                "    others = oom[\"capacity\"] - oom[\"free\"]\n"
                "    return \"other processes\" if others >= oom[\"requested\"] else \"too big\"\n",
                "counted as other processes"),
        Mistake(_DIAG_SIG + "    if oom[\"reserved_unallocated\"] >= oom[\"requested\"]:\n"
                "        return \"fragmentation\"\n"
                "    return \"too big\"\n",
                "freeing them (another notebook's kernel?)"),
        Mistake(_DIAG_SIG + "    if oom[\"reserved_unallocated\"] > oom[\"requested\"]:\n"
                "        return \"fragmentation\"\n"
                "    others = oom[\"capacity\"] - oom[\"free\"] - oom[\"process\"]\n"
                "    if others > oom[\"requested\"]:\n"
                "        return \"other processes\"\n"
                "    return \"too big\"\n", "`>` instead of `>=`"),
        Mistake(_DIAG_SIG + "    others = oom[\"capacity\"] - oom[\"free\"] - oom[\"process\"]\n"
                "    if others >= oom[\"requested\"]:\n"
                "        return \"other processes\"\n"
                "    if oom[\"reserved_unallocated\"] >= oom[\"requested\"]:\n"
                "        return \"fragmentation\"\n"
                "    return \"too big\"\n", "the other processes were checked first"),
    ],
))


# --- 05.3 a step that survives the OOM ----------------------------------------------------------------

def train_in_parts(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                   parts: int) -> None:
    """One optimizer step on (x, y) computed in `parts` micro-batches: the same update as one big batch."""
    optimizer.zero_grad(set_to_none=True)
    n = len(x)
    for xs, ys in zip(x.chunk(parts), y.chunk(parts)):  # chunk: views, no copies
        loss = F.cross_entropy(model(xs), ys) * (len(xs) / n)  # this part's share of the batch mean
        loss.backward()
    optimizer.step()


_IN_PARTS_SOURCE = '''def train_in_parts(model, optimizer, x, y, parts):
    """One optimizer step on (x, y) computed in `parts` micro-batches: the same update as one big batch."""
    optimizer.zero_grad(set_to_none=True)
    n = len(x)
    for xs, ys in zip(x.chunk(parts), y.chunk(parts)):  # chunk: views, no copies
        loss = F.cross_entropy(model(xs), ys) * (len(xs) / n)  # this part's share of the batch mean
        loss.backward()
    optimizer.step()
'''

_SURVIVE_BATCH = 512


def _survive_setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    model = _mlp(width=64, depth=4)  # activations dominate the peak, as in most real models
    return model, torch.optim.SGD(model.parameters(), lr=0.1), *_data(_SURVIVE_BATCH)


_PEAKS: dict[int, tuple[int, int]] = {}


def _step_peak(parts: int) -> tuple[int, int]:
    """(memory before, peak) of train_in_parts(..., parts) on the checker's model and batch, on a SimulatedGPU."""
    if parts not in _PEAKS:
        model, opt, x, y = _survive_setup()
        with SimulatedGPU("1GiB", model=model, optimizer=opt) as gpu:
            gpu.track(x, y)
            before = gpu.memory_allocated()
            train_in_parts(model, opt, x, y, parts)
            _PEAKS[parts] = (before, gpu.max_memory_allocated())
    return _PEAKS[parts]


def _budget_between(fits: int, fails: int) -> int:
    """A budget where a step in `fits` parts fits and one in `fails` parts does not."""
    low, high = _step_peak(fits)[1], _step_peak(fails)[1]
    return low + (high - low) // 4


_ENDLESS = 8  # out-of-memory errors in one call: far more than halving 512 samples down to parts that fit needs


def _check_survive(survive):
    observe(lambda: _require_function(survive, "survive"))
    *_unused, x, y = _survive_setup()
    oracle, oracle_opt, *_unused = _survive_setup()
    train_in_parts(oracle, oracle_opt, x, y, 1)  # the full-batch update, no memory limit
    for label, budget in ((N_("with memory to spare"), 2 ** 30),
                          (N_("where the full batch does not fit but halves do"), _budget_between(2, 1)),
                          (N_("where only quarters of the batch fit"), _budget_between(4, 2))):
        model, opt, *_unused = _survive_setup()
        start = _values(model)

        def step():
            """survive() on a SimulatedGPU of `budget`: (its failure or None, still running when the time was up,
            the out-of-memory errors raised, the parameters after)."""
            gpu = SimulatedGPU(budget, model=model, optimizer=opt)
            failure, stalled = None, False
            with gpu:
                gpu.track(x, y)
                try:
                    call(survive, model, opt, x, y, name="survive", check_mutation=False)
                except Incorrect as exc:
                    failure = str(exc)
                except AnswerTimeout:
                    if gpu.oom_count < _ENDLESS:
                        raise
                    stalled = True
            return failure, stalled, gpu.oom_count, _values(model)

        failure, stalled, oom_count, after = observe(step)
        if stalled:
            failure = _("it was still running after the time allowed")
        where = _("on a simulated GPU {condition} ({budget})").format(condition=_(label), budget=format_bytes(budget))
        if failure is not None:
            if "OutOfMemoryError" not in failure and oom_count >= _ENDLESS:  # an endless retry, then a crash
                raise Incorrect(_("{where}: survive ran out of memory {count} times and never got through: likely "
                                  "mistake: the retry runs inside the except block (a recursive call from the except "
                                  "block too), where every failed attempt's tensors are still held, so each retry "
                                  "has less memory than the one before; leave the except block first, then retry. "
                                  "(In the end: {failure})").format(where=where, count=oom_count,
                                                                    failure=failure.split(" raised ", 1)[-1]))
            if "OutOfMemoryError" not in failure:
                raise Incorrect(failure)
            if oom_count <= 1:
                raise Incorrect(_("{where}: the out-of-memory error came out of survive: catch "
                                  "torch.OutOfMemoryError and retry the step in smaller parts").format(where=where))
            if "halves" in label:
                raise Incorrect(_("{where}: the retry ran out of memory too: likely mistake: the retry runs inside "
                                  "the except block, where the exception's traceback still holds the failed "
                                  "attempt's tensors; leave the except block first, then retry").format(where=where))
            raise Incorrect(_("{where}: survive still ran out of memory ({count} errors): keep halving the "
                              "parts (2, 4, 8, ...) until the step fits, each retry after the except block").format(
                where=where, count=oom_count))
        if all(torch.equal(p, s) for p, s in zip(after, start)):
            raise Incorrect(_("{where}: the parameters did not change: the batch was skipped; retry it in smaller "
                              "parts so that no data is lost").format(where=where))
        if not _same_parameters(after, _values(oracle)):
            raise Incorrect(_("{where}: the update differs from the full batch's; use train_in_parts, which "
                              "weights each part by its share of the batch").format(where=where))
    return _("the same update as the full batch, however little memory there is")


_SURVIVE_SIG = ("def survive(model, optimizer, x, y):\n"
                "    \"\"\"One training step on (x, y) that survives running out of memory: on OOM, retry it in 2, 4, 8 ...\n"
                "    parts with train_in_parts.\"\"\"\n")

register(Exercise(
    id="05.3", title=N_("Make the step survive the OOM"), answer="survive",
    blank=_SURVIVE_SIG + "    raise NotImplementedError  # your code here\n",
    solution=(_SURVIVE_SIG
              + "    parts = 1\n"
                "    while True:\n"
                "        try:\n"
                "            train_in_parts(model, optimizer, x, y, parts)\n"
                "            return\n"
                "        except torch.OutOfMemoryError:\n"
                "            if parts >= len(x):\n"
                "                raise  # not even one sample fits\n"
                "        # here the except block has ended: the failed attempt's tensors are gone\n"
                "        parts *= 2\n"),
    setup="import torch\nimport torch.nn.functional as F\n\n" + _IN_PARTS_SOURCE,
    checker=_check_survive,
    inside=N_("the out-of-memory errors a simulated GPU raised while the answer ran"),
    hints=[N_("A `while True:` loop around try/except: the next iteration starts after the except block has "
              "ended, so the failed attempt's tensors are already freed."),
           N_("In the except block only decide (or re-raise when parts cannot grow); double `parts` and loop.")],
    mistakes=[
        Mistake(_SURVIVE_SIG + "    try:\n        train_in_parts(model, optimizer, x, y, 1)\n"
                "    except torch.OutOfMemoryError:\n        train_in_parts(model, optimizer, x, y, 2)\n",
                "inside the except block"),
        Mistake(_SURVIVE_SIG.replace("y):", "y, parts=1):", 1) + "    try:\n        train_in_parts(model, optimizer, x, y, parts)\n"
                "    except torch.OutOfMemoryError:\n        survive(model, optimizer, x, y, parts * 2)\n",
                "a recursive call from the except block"),
        Mistake(_SURVIVE_SIG + "    try:\n        train_in_parts(model, optimizer, x, y, 1)\n"
                "    except torch.OutOfMemoryError:\n        pass  # skip this batch\n", "skipped"),
        Mistake(_SURVIVE_SIG + "    failed = False\n    try:\n        train_in_parts(model, optimizer, x, y, 1)\n"
                "    except torch.OutOfMemoryError:\n        failed = True\n"
                "    if failed:\n        train_in_parts(model, optimizer, x, y, 2)\n", "keep halving"),
    ],
))


# --- 05.4 the leak that keeps memory high after recovery ------------------------------------------------

_LEAK_SIZES = (16, 128, 16)


def _leak_setup() -> tuple[nn.Module, torch.optim.Optimizer, list[tuple[torch.Tensor, torch.Tensor]]]:
    model = _mlp(width=256, depth=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [_data(n, seed=10 + i) for i, n in enumerate(_LEAK_SIZES)]
    return model, opt, batches


def _leak_budget() -> int:
    """Batches of 16 fit (with room for a leaked one), a batch of 128 does not."""
    model, opt, batches = _leak_setup()
    peaks = {}
    for n in (16, 128):
        m = _clone(model)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        x, y = next(b for b in batches if len(b[0]) == n)
        with SimulatedGPU("1GiB", model=m, optimizer=o) as gpu:
            gpu.track(x, y)
            train_in_parts(m, o, x, y, 1)
            peaks[n] = gpu.max_memory_allocated()
    return (peaks[16] + peaks[128]) // 2


def _check_clean_epoch(clean_epoch):
    observe(lambda: _require_function(clean_epoch, "clean_epoch"))
    budget = _leak_budget()
    model, opt, batches = _leak_setup()
    oracle, oracle_opt, _batches = _leak_setup()
    oracle_losses = []
    for x, y in batches:
        if len(x) == 16:
            oracle_opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(oracle(x), y)
            loss.backward()
            oracle_opt.step()
            oracle_losses.append(loss.detach())

    def epoch():
        """clean_epoch() on a SimulatedGPU of `budget`: the memory it left behind and what it returned."""
        with SimulatedGPU(budget, model=model, optimizer=opt) as gpu:
            gpu.track(*[t for b in batches for t in b])
            before = gpu.memory_allocated()
            result = call(clean_epoch, model, opt, list(batches), name="clean_epoch", check_mutation=False)
            extra = gpu.memory_allocated() - before  # while the returned losses still live
        grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
        if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(r, list) for r in result)):
            return {"result": describe(result)}
        losses, errors = result
        return {"extra": extra, "grads": grads, "losses": list(losses), "errors": list(errors),
                "kept_exception": any(isinstance(e, BaseException) for e in errors), "after": _values(model)}

    seen = observe(epoch)
    if "result" in seen:
        raise Incorrect(_("clean_epoch should return a pair of lists (losses, errors), got {value}").format(
            value=seen["result"]))
    losses, errors, extra = seen["losses"], seen["errors"], seen["extra"]
    if seen["kept_exception"]:
        raise Incorrect(_("memory after the epoch is {extra} above where it started: "
                          "likely mistake: the exception object was kept; its __traceback__ holds the failed "
                          "step's frames and, through them, every tensor the step had made; keep a message "
                          "(str) instead").format(extra=format_bytes(extra)))
    if not all(isinstance(e, str) for e in errors):
        raise Incorrect(_("errors should hold one message (a str) per batch that ran out of memory, got "
                          "{values}").format(values=[describe(e) for e in errors]))
    if any(isinstance(v, (int, float)) and not isinstance(v, bool) for v in losses):
        raise Incorrect(_("the losses are Python numbers: likely mistake: a per-step .item() (or float()), "
                          "which makes the CPU wait for the GPU at every step; keep loss.detach() (a tensor on "
                          "the device) and convert once, after the epoch"))
    if not all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in losses):
        raise Incorrect(_("losses should hold one 0-d loss tensor per batch that trained, got "
                          "{values}").format(values=[describe(v) for v in losses][:4]))
    if any(v.requires_grad for v in losses):  # observe() keeps requires_grad: set on every loss with a grad_fn
        raise Incorrect(_("the losses still carry their autograd graph (grad_fn): likely mistake: the loss was "
                          "kept without .detach(); a loss kept this way before backward, or in evaluation "
                          "without no_grad, keeps every activation alive; append loss.detach()"))
    if len(errors) > 1 and len(losses) + len(errors) == len(_LEAK_SIZES):
        raise Incorrect(_("of the batches of {sizes} samples only the one of 128 runs out of memory here, but "
                          "{errors} did: likely mistake: something kept the failed step's tensors alive after "
                          "the except block (the exception object in a variable, whose __traceback__ holds "
                          "the step's frames), so the next batch had less memory; keep only str(e)").format(
            sizes=list(_LEAK_SIZES), errors=len(errors)))
    if len(errors) != 1 or len(losses) != 2:
        raise Incorrect(_("of the batches of {sizes} samples only the one of 128 runs out of memory "
                          "here: expected 2 losses and 1 error, got {losses} and {errors}").format(
            sizes=list(_LEAK_SIZES), losses=len(losses), errors=len(errors)))
    if not all(e.strip() for e in errors):
        raise Incorrect(_("an error message is empty: keep the exception's text, e.g. str(e)"))
    grads = seen["grads"]
    allowance = grads + 2048 * (len(losses) + 1) + 64 * 1024
    if extra > allowance:
        raise Incorrect(_("after the epoch {extra} more memory is in use than before "
                          "(gradients and the kept losses need only {needed}): "
                          "something still refers to a step's tensors").format(
            extra=format_bytes(extra), needed=format_bytes(grads + 512 * len(losses))))
    for got, want in zip(losses, oracle_losses):
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            raise Incorrect(_("the losses {got} differ from a plain training step's {expected}").format(
                got=[round(float(v), 4) for v in losses], expected=[round(float(v), 4) for v in oracle_losses]))
    if not _same_parameters(seen["after"], _values(oracle)):
        raise Incorrect(_("the parameters differ from two plain training steps on the batches that fit: zero the "
                          "gradients before each step, then forward, backward and optimizer.step()"))
    _check_other_errors_reach_the_caller(clean_epoch)
    return _("memory after recovery is back to the model, its gradients and {count} small loss tensors").format(
        count=len(losses))


def _check_other_errors_reach_the_caller(clean_epoch):
    """Only running out of memory is skipped: a batch with a bug (the wrong number of features) must raise."""
    model, opt, batches = _leak_setup()
    with seeded(12):
        buggy = (torch.randn(16, 31), torch.randint(0, 10, (16,)))  # the model takes 32 features

    def epoch():
        """(whether the error reached the caller, the first error clean_epoch recorded instead, shown)"""
        try:
            result = clean_epoch(model, opt, [batches[0], buggy, batches[2]])
        except AnswerTimeout:
            raise
        except Exception:  # the shape error (or any error) reached the caller: as it should
            return True, None
        errors = result[1] if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], list) else []
        return False, _short(errors[0]) if errors else None

    reached, recorded = observe(epoch)
    if reached:
        return
    raise Incorrect(_("a batch with a bug (16 samples of 31 features, for a model that takes 32) raised a "
                      "RuntimeError that is not an out-of-memory error, and clean_epoch went on{recorded}: likely "
                      "mistake: the except clause is broader than torch.OutOfMemoryError (Exception, RuntimeError "
                      "or a bare except), which hides real bugs as skipped batches; catch torch.OutOfMemoryError "
                      "only, and let every other error reach the caller").format(
        recorded=_(" (recorded as {error})").format(error=recorded) if recorded is not None else ""))


_LEAK_SIG = ("def clean_epoch(model, optimizer, batches):\n"
             "    \"\"\"One training step per (x, y) in batches; a batch that runs out of memory is skipped. Returns\n"
             "    (losses, errors): a detached 0-d loss tensor per batch that trained, a message (str) per batch that\n"
             "    did not.\"\"\"\n")

register(Exercise(
    id="05.4", title=N_("Find the leak that keeps memory high after recovery"), answer="clean_epoch",
    blank=_LEAK_SIG + "    raise NotImplementedError  # your code here\n",
    solution=(_LEAK_SIG
              + "    losses, errors = [], []\n"
                "    for x, y in batches:\n"
                "        optimizer.zero_grad(set_to_none=True)\n"
                "        try:\n"
                "            loss = F.cross_entropy(model(x), y)\n"
                "            loss.backward()\n"
                "            optimizer.step()\n"
                "            losses.append(loss.detach())  # no graph, no .item(): stays on the device\n"
                "        except torch.OutOfMemoryError as e:\n"
                "            errors.append(str(e).splitlines()[0])  # the text, not the exception (its traceback)\n"
                "        loss = None  # nothing of this step outlives it\n"
                "    return losses, errors\n"),
    setup="import torch\nimport torch.nn.functional as F\n",
    checker=_check_clean_epoch,
    inside=N_("the memory a simulated GPU counted while the answer ran"),
    hints=[N_("Start from leaky_epoch above. Two things it keeps outlive the step: find what refers to the "
              "failed step's tensors after the except block has ended."),
           N_("An exception object keeps its __traceback__, and the traceback keeps every frame of the failed "
              "step with its local tensors: store str(e). Append loss.detach(), not loss.")],
    mistakes=[
        Mistake(_LEAK_SIG + "    losses, errors = [], []\n    for x, y in batches:\n"
                "        optimizer.zero_grad(set_to_none=True)\n        try:\n"
                "            loss = F.cross_entropy(model(x), y)\n            loss.backward()\n"
                "            optimizer.step()\n            losses.append(loss.detach())\n"
                "        except torch.OutOfMemoryError as e:\n            errors.append(e)\n"
                "    return losses, errors\n", "the exception object was kept"),
        Mistake(_LEAK_SIG + "    losses, errors = [], []\n    for x, y in batches:\n"
                "        optimizer.zero_grad(set_to_none=True)\n        try:\n"
                "            loss = F.cross_entropy(model(x), y)\n            loss.backward()\n"
                "            optimizer.step()\n            losses.append(loss)\n"
                "        except torch.OutOfMemoryError as e:\n            errors.append(str(e))\n"
                "    return losses, errors\n", "without .detach()"),
        Mistake(_LEAK_SIG + "    losses, errors = [], []\n    for x, y in batches:\n"
                "        optimizer.zero_grad(set_to_none=True)\n        try:\n"
                "            loss = F.cross_entropy(model(x), y)\n            loss.backward()\n"
                "            optimizer.step()\n            losses.append(loss.item())\n"
                "        except torch.OutOfMemoryError as e:\n            errors.append(str(e))\n"
                "    return losses, errors\n", "per-step .item()"),
        Mistake(_LEAK_SIG + "    losses, errors = [], []\n    for x, y in batches:\n"
                "        optimizer.zero_grad(set_to_none=True)\n        try:\n"
                "            loss = F.cross_entropy(model(x), y)\n            loss.backward()\n"
                "            optimizer.step()\n            losses.append(loss.detach())\n"
                "        except Exception as e:  # skip whatever goes wrong\n            errors.append(str(e))\n"
                "    return losses, errors\n", "broader than torch.OutOfMemoryError"),
        Mistake(_LEAK_SIG + "    losses, errors, last_error = [], [], None\n    for x, y in batches:\n"
                "        optimizer.zero_grad(set_to_none=True)\n        try:\n"
                "            loss = F.cross_entropy(model(x), y)\n            loss.backward()\n"
                "            optimizer.step()\n            losses.append(loss.detach())\n"
                "        except torch.OutOfMemoryError as e:\n            errors.append(str(e))\n"
                "            last_error = e  # kept to look at later\n"
                "    return losses, errors\n", "something kept the failed step's tensors alive"),
    ],
))


# --- 05.6 the largest batch that fits ------------------------------------------------------------------

def _affine(fixed: int, per_sample: int) -> Callable[[int], int]:
    def peak_at(batch_size: int) -> int:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(_("peak_at takes a batch size >= 1 (an int), got {batch_size!r}").format(
                batch_size=batch_size))
        return fixed + per_sample * batch_size
    return peak_at


def _max_batch_cases() -> list[tuple[int, int, int]]:
    """(fixed bytes, bytes per sample, budget)."""
    return [(5_000_000, 300_000, 20_000_000),               # 50
            (1_900_000, 318_000, 24 * _MIB),                # not a whole number: round down
            (40 * _MIB, 2 * _MIB, 40 * _MIB + 96 * _MIB),  # exactly 48 fit: the boundary fits
            (30 * _MIB, 1 * _MIB, 24 * _MIB),              # nothing fits
            (3 * _GIB, 37 * _MIB, 16 * _GIB),              # a GPU-sized case
            (23 * _MIB, 1 * _MIB, 24 * _MIB)]              # exactly one sample fits: peak_at(1) == budget


def _check_max_batch_size(max_batch_size):
    observe(lambda: _require_function(max_batch_size, "max_batch_size"))
    for fixed, per, budget in _max_batch_cases():
        expected = max(0, (budget - fixed) // per)
        got = observe(lambda: call(max_batch_size, _affine(fixed, per), budget, name="max_batch_size",
                                   check_mutation=False))
        if isinstance(got, float) and got.is_integer():
            got = int(got)
        if isinstance(got, bool) or not isinstance(got, int):
            raise Incorrect(_("max_batch_size should return a whole number of samples (an int), got {value}").format(
                value=describe(got)))
        if got == expected:
            continue
        shown = _("with {fixed} fixed, {per} per sample and a budget of {budget}: got {got}, expected "
                  "{expected}").format(fixed=format_bytes(fixed), per=format_bytes(per), budget=format_bytes(budget),
                                       got=got, expected=expected)
        if got < 0:
            raise Incorrect(_("{shown}: likely mistake: a negative batch size; return 0 when even one sample "
                              "does not fit").format(shown=shown))
        if got == expected - 1 and fixed + per * expected == budget:
            raise Incorrect(_("{shown}: likely mistake: a peak equal to the budget was taken as not fitting: the "
                              "peak at batch size {expected} is exactly the budget, and that fits (peak_at(b) <= "
                              "budget, not <)").format(shown=shown, expected=expected))
        if 0 < got < expected and got & (got - 1) == 0 and fixed + per * 2 * got > budget:
            raise Incorrect(_("{shown}: likely mistake: the batch size was doubled until the next doubling no "
                              "longer fits, which finds only powers of two; the largest batch that fits lies "
                              "between {got} and {double}: solve fixed + per_sample * b <= budget for b").format(
                shown=shown, got=got, double=2 * got))
        if got == budget // per or got == math.ceil(budget / per):
            raise Incorrect(_("{shown}: likely mistake: the fixed part (parameters, gradients, optimizer state) "
                              "was ignored; only what is left of the budget after it is shared by the "
                              "samples").format(shown=shown))
        if got == budget // (fixed + per):
            raise Incorrect(_("{shown}: likely mistake: peak_at(1) was used as the cost of one sample, which "
                              "counts the fixed part once per sample; the cost per sample is peak_at(2) - "
                              "peak_at(1)").format(shown=shown))
        if got == expected + 1:
            raise Incorrect(_("{shown}: likely mistake: rounded up, so the last sample does not fit; round "
                              "down").format(shown=shown))
        raise Incorrect(shown)
    return _("fixed part first, then what is left divided by the cost of one sample, rounded down")


_MAX_SIG = ("def max_batch_size(peak_at, budget):\n"
            "    \"\"\"The largest batch size b with peak_at(b) <= budget (0 if none), where peak_at(b) = fixed + per_sample * b.\"\"\"\n")

register(Exercise(
    id="05.6", title=N_("The largest batch that fits, predicted"), answer="max_batch_size",
    blank=_MAX_SIG + "    raise NotImplementedError  # your code here\n",
    solution=(_MAX_SIG
              + "    per_sample = peak_at(2) - peak_at(1)\n"
                "    fixed = peak_at(1) - per_sample\n"
                "    return max(0, int((budget - fixed) // per_sample))  # round down: the last sample must fit\n"),
    setup="",
    checker=_check_max_batch_size,
    hints=[N_("Two evaluations give the line: per_sample = peak_at(2) - peak_at(1), and fixed = peak_at(1) - "
              "per_sample."),
           N_("Solve fixed + per_sample * b <= budget for b, round down with //, and never return less than 0.")],
    mistakes=[
        Mistake(_MAX_SIG + "    return budget // (peak_at(2) - peak_at(1))\n", "fixed part"),
        Mistake(_MAX_SIG + "    return budget // peak_at(1)\n", "counts the fixed part once per sample"),
        Mistake(_MAX_SIG + "    per_sample = peak_at(2) - peak_at(1)\n    fixed = peak_at(1) - per_sample\n"
                "    import math\n    return max(0, math.ceil((budget - fixed) / per_sample))\n", "rounded up"),
        Mistake(_MAX_SIG + "    if peak_at(1) >= budget:\n        return 0  # not even one sample fits\n"
                "    per_sample = peak_at(2) - peak_at(1)\n    fixed = peak_at(1) - per_sample\n"
                "    return (budget - fixed) // per_sample\n", "a peak equal to the budget"),
        Mistake(_MAX_SIG + "    b = 0\n    while peak_at(b + 1) < budget:\n        b += 1\n    return b\n",
                "a peak equal to the budget"),
        Mistake(_MAX_SIG + "    if peak_at(1) > budget:\n        return 0\n    b = 1\n"
                "    while peak_at(2 * b) <= budget:\n        b *= 2\n    return b\n", "only powers of two"),
    ],
))


# --- 05.7 gradient accumulation with a shorter last group -------------------------------------------------

def _accumulation_setup() -> tuple[nn.Module, torch.optim.Optimizer, list[tuple[torch.Tensor, torch.Tensor]]]:
    model = _mlp(width=24, depth=2, inputs=12, seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    batches = [_data(4, inputs=12, seed=20 + i) for i in range(7)]
    return model, opt, batches


def _group_updates(batches, k: int, divide: Callable[[int], float], last: bool = True, each: bool = False,
                   zero_each: bool = False):
    """Parameter values after accumulation by a given rule: loss / divide(group size); the last group applied or not;
    `each`: a step after every micro-batch (no accumulation); `zero_each`: zero_grad before every micro-batch
    (only the group's last micro-batch counts)."""
    model, opt, _batches = _accumulation_setup()
    groups = [batches[i:i + k] for i in range(0, len(batches), k)]
    if not last and len(groups[-1]) < k:
        groups = groups[:-1]
    for group in groups:
        opt.zero_grad(set_to_none=True)
        for x, y in group:
            if zero_each:
                opt.zero_grad(set_to_none=True)
            (F.cross_entropy(model(x), y) / divide(len(group))).backward()
            if each:
                opt.step()
                opt.zero_grad(set_to_none=True)
        if not each:
            opt.step()
    return _values(model)


def _check_accumulate(accumulate):
    observe(lambda: _require_function(accumulate, "accumulate"))
    k = 3
    model, opt, batches = _accumulation_setup()
    start = _values(model)

    def run(model, opt):
        """accumulate() on the checker's model: the parameters after (the answer gets copies of the batches, so
        what it does to them does not reach the checker's own)."""
        given = [(x.clone(), y.clone()) for x, y in batches]
        call(accumulate, model, opt, given, k, name="accumulate", check_mutation=False)
        return _values(model)

    after = observe(lambda: run(model, opt))
    if all(torch.equal(p, s) for p, s in zip(after, start)):
        raise Incorrect(_("the parameters did not change: call optimizer.step() once per group"))
    # the oracle: one step per group on the group's micro-batches concatenated
    oracle, oracle_opt, _batches = _accumulation_setup()
    for i in range(0, len(batches), k):
        group = batches[i:i + k]
        oracle_opt.zero_grad(set_to_none=True)
        x, y = torch.cat([b[0] for b in group]), torch.cat([b[1] for b in group])
        F.cross_entropy(oracle(x), y).backward()
        oracle_opt.step()
    sizes = [len(batches[i:i + k]) for i in range(0, len(batches), k)]
    shown = _("with {count} micro-batches and k={k} (groups of {sizes})").format(count=len(batches), k=k, sizes=sizes)
    oracle = _values(oracle)
    if _same_parameters(after, oracle):
        # the same run on a model whose p.grad still holds the gradients of an earlier backward (a cell run before)
        stale, stale_opt, _batches = _accumulation_setup()
        with seeded(30):
            F.cross_entropy(stale(torch.randn(4, 12)), torch.randint(0, 10, (4,))).backward()
        if not _same_parameters(observe(lambda: run(stale, stale_opt)), oracle):
            raise Incorrect(_("{shown}, on a model whose p.grad still held the gradients of an earlier backward: "
                              "the parameters differ from one step per group: likely mistake: zero_grad() only "
                              "after each step, so the first group's step also applied those old gradients; call "
                              "optimizer.zero_grad() at the start of each group, before its first "
                              "backward").format(shown=shown))
        return _("every update equals the big batch's, the short last group included")
    if _same_parameters(after, _group_updates(batches, k, lambda n: k, last=False)):
        raise Incorrect(_("{shown}: likely mistake: the last group ({last} micro-batch) was never applied: a step "
                          "only when (i + 1) % k == 0, or a loop over the full groups only, leaves out the "
                          "micro-batches after the last full group; the shorter last group needs its step "
                          "too").format(shown=shown, last=sizes[-1]))
    if _same_parameters(after, _group_updates(batches, k, lambda n: n, zero_each=True)) or \
            _same_parameters(after, _group_updates(batches, k, lambda n: 1, zero_each=True)):
        raise Incorrect(_("{shown}: likely mistake: zero_grad() before every micro-batch, which throws away the "
                          "gradients the group accumulated so far, so each step applies only the last "
                          "micro-batch's; zero_grad once per group, before its first backward").format(shown=shown))
    if _same_parameters(after, _group_updates(batches, k, lambda n: k)):
        raise Incorrect(_("{shown}: likely mistake: the shorter last group's loss was divided by k; divide each "
                          "group's losses by the number of micro-batches in that group").format(shown=shown))
    if _same_parameters(after, _group_updates(batches, k, lambda n: 1)):
        raise Incorrect(_("{shown}: likely mistake: the losses were not divided; accumulated gradients add up, "
                          "so a group of n micro-batches gives n times the mean gradient: divide each loss by "
                          "n").format(shown=shown))
    if _same_parameters(after, _group_updates(batches, k, lambda n: n, each=True)) or \
            _same_parameters(after, _group_updates(batches, k, lambda n: 1, each=True)):
        raise Incorrect(_("{shown}: likely mistake: a step after every micro-batch; accumulate the group's "
                          "gradients first, then one optimizer.step() and one zero_grad() per group").format(
            shown=shown))
    raise Incorrect(_("{shown}: the parameters differ from one step per group on the concatenated "
                      "micro-batches").format(shown=shown))


_ACC_SIG = ("def accumulate(model, optimizer, batches, k):\n"
            "    \"\"\"Train on a list of equal-sized (x, y) micro-batches with one optimizer step per group of k (the\n"
            "    last group may be shorter); each step equals one step on its group concatenated.\"\"\"\n")

register(Exercise(
    id="05.7", title=N_("Gradient accumulation, the last group included"), answer="accumulate",
    blank=_ACC_SIG + "    raise NotImplementedError  # your code here\n",
    solution=(_ACC_SIG
              + "    for start in range(0, len(batches), k):\n"
                "        group = batches[start:start + k]  # the last one may be shorter\n"
                "        optimizer.zero_grad(set_to_none=True)\n"
                "        for x, y in group:\n"
                "            loss = F.cross_entropy(model(x), y) / len(group)  # the group's mean, not k\n"
                "            loss.backward()  # gradients add up in p.grad\n"
                "        optimizer.step()\n"),
    setup="import torch\nimport torch.nn.functional as F\n",
    checker=_check_accumulate,
    hints=[N_("Loop over groups: batches[start:start + k] for start in range(0, len(batches), k)."),
           N_("Inside a group: zero_grad once, then for each micro-batch loss / len(group) and backward; then one "
              "optimizer.step().")],
    mistakes=[
        Mistake(_ACC_SIG + "    optimizer.zero_grad()\n    for i, (x, y) in enumerate(batches):\n"
                "        loss = F.cross_entropy(model(x), y) / k\n        loss.backward()\n"
                "        if (i + 1) % k == 0:\n            optimizer.step()\n            optimizer.zero_grad()\n",
                "never applied"),
        Mistake(_ACC_SIG + "    for start in range(0, len(batches), k):\n        optimizer.zero_grad()\n"
                "        for x, y in batches[start:start + k]:\n"
                "            (F.cross_entropy(model(x), y) / k).backward()\n        optimizer.step()\n",
                "divided by k"),
        Mistake(_ACC_SIG + "    for start in range(0, len(batches), k):\n        optimizer.zero_grad()\n"
                "        for x, y in batches[start:start + k]:\n"
                "            F.cross_entropy(model(x), y).backward()\n        optimizer.step()\n",
                "not divided"),
        Mistake(_ACC_SIG + "    for x, y in batches:\n        optimizer.zero_grad()\n"
                "        F.cross_entropy(model(x), y).backward()\n        optimizer.step()\n",
                "a step after every micro-batch"),
        Mistake(_ACC_SIG + "    for start in range(0, len(batches), k):\n        group = batches[start:start + k]\n"
                "        for x, y in group:\n            (F.cross_entropy(model(x), y) / len(group)).backward()\n"
                "        optimizer.step()\n        optimizer.zero_grad()  # ready for the next group\n",
                "so the first group's step also applied those old gradients"),
        Mistake(_ACC_SIG + "    for g in range(len(batches) // k):\n        group = batches[g * k:(g + 1) * k]\n"
                "        optimizer.zero_grad()\n        for x, y in group:\n"
                "            (F.cross_entropy(model(x), y) / len(group)).backward()\n        optimizer.step()\n",
                "a loop over the full groups only"),
        Mistake(_ACC_SIG + "    for start in range(0, len(batches), k):\n        group = batches[start:start + k]\n"
                "        for x, y in group:\n            optimizer.zero_grad()\n"
                "            (F.cross_entropy(model(x), y) / len(group)).backward()\n        optimizer.step()\n",
                "zero_grad() before every micro-batch"),
    ],
))


# --- 05.5 the Trainer's memory check in one function --------------------------------------------------

def _fit_estimates():
    """Real estimates (fake tensors: nothing allocated) of a small model with Adam and with SGD."""
    from ..memory import estimate_training_memory

    out = []
    for make_opt in (lambda p: torch.optim.Adam(p), lambda p: torch.optim.SGD(p, lr=0.1)):
        model = _mlp(width=96, depth=3, inputs=48, seed=5)
        out.append(estimate_training_memory(model, make_opt(model.parameters()), _data(64, inputs=48, seed=6),
                                            F.cross_entropy))
    return out


_FIT_RULES = [  # (a rule a learner may write, its feedback)
    (lambda e, free: e.total <= free,
     N_("the whole predicted peak was compared with the free memory, but the parameters and the batch are already "
        "in memory (they are not in what is free): compare total - parameters - batch")),
    (lambda e, free: e.activations <= free,
     N_("only the activations were compared; the step also creates the gradients and (on its first step) the "
        "optimizer state")),
    (lambda e, free: e.parameters + e.gradients + e.optimizer_state + e.activations <= free,
     N_("the parts were added up (parameters + gradients + state + activations); the peak is less than their sum, "
        "since activations are freed while the gradients grow, and the parameters already exist: use "
        "estimate.total")),
    (lambda e, free: e.total - e.parameters - e.batch < free,
     N_("a step that needs exactly the free memory does not fit with `<`; it does: use `<=`")),
    (lambda e, free: e.total - e.parameters <= free,
     N_("only the parameters were subtracted; the batch is already on the device too, so it is not in what is "
        "free either: compare total - parameters - batch")),
    (lambda e, free: e.total - e.parameters - e.batch - e.optimizer_state <= free,
     N_("the optimizer state was subtracted as if it were already in memory; before the first step it does not "
        "exist yet: optimizer.step() creates it, inside the predicted peak")),
    (lambda e, free: e.total - e.parameters - e.batch - e.gradients <= free,
     N_("the gradients were subtracted as if they were already in memory; before the first step there are none: "
        "backward creates them, inside the predicted peak")),
]


def _check_will_fit(will_fit):
    observe(lambda: _require_function(will_fit, "will_fit"))
    cases, handed = [], []  # the checker reads only its own copy of each estimate, the answer gets the other
    for given in _fit_estimates():
        est = copy.deepcopy(given)
        needed = est.total - est.parameters - est.batch
        parts = est.parameters + est.gradients + est.optimizer_state + est.activations
        for free in (needed, needed - 1, (needed + est.total) // 2, (est.activations + needed) // 2,
                     (needed + min(parts, est.total)) // 2, est.total, est.activations,
                     needed + est.batch // 2, needed - est.gradients // 2, needed - est.optimizer_state // 2):
            cases.append((est, free, needed <= free))
            handed.append(given)
    answers = []
    for (_est, free, _fits), given in zip(cases, handed):
        got = observe(lambda: call(will_fit, given, free, name="will_fit", check_mutation=False))
        if not isinstance(got, bool):
            raise Incorrect(_("will_fit should return True or False, got {value}").format(value=describe(got)))
        answers.append(got)
    if answers == [expected for _est, _free, expected in cases]:
        return _("the same comparison the Trainer makes before its first step")
    for rule, feedback in _FIT_RULES:
        if answers == [rule(est, free) for est, free, _fits in cases]:
            raise Incorrect(_("likely mistake: {feedback}").format(feedback=_(feedback)))
    est, free, expected = next(c for c, a in zip(cases, answers) if a != c[2])
    if expected:
        template = _("with {free} free (predicted peak {total}, of which parameters {parameters} and batch {batch} "
                     "already exist) you said {answer}, but it fits: the step needs {needed} more than what "
                     "already exists")
    else:
        template = _("with {free} free (predicted peak {total}, of which parameters {parameters} and batch {batch} "
                     "already exist) you said {answer}, but it does not fit: the step needs {needed} more than "
                     "what already exists")
    raise Incorrect(template.format(free=format_bytes(free), total=format_bytes(est.total),
                                    parameters=format_bytes(est.parameters), batch=format_bytes(est.batch),
                                    answer=not expected, needed=format_bytes(est.total - est.parameters - est.batch)))


_FIT_SIG = ("def will_fit(estimate, free_bytes):\n"
            "    \"\"\"Will a training step fit? `estimate`: estimate_training_memory(model, optimizer, batch, ...) for a model\n"
            "    and a batch already on the device; `free_bytes`: what the device still has free.\"\"\"\n")

register(Exercise(
    id="05.5", title=N_("The Trainer's memory check in one function"), answer="will_fit",
    blank=_FIT_SIG + "    raise NotImplementedError  # your code here\n",
    solution=(_FIT_SIG
              + "    # parameters and batch are already allocated: only the rest of the peak must fit in what is free\n"
                "    still_needed = estimate.total - estimate.parameters - estimate.batch\n"
                "    return still_needed <= free_bytes\n"),
    setup="",
    checker=_check_will_fit,
    hints=[N_("estimate.total is the predicted peak of everything, including what already exists."),
           N_("Which parts of the peak are in memory before the step starts? They are not in `free_bytes`.")],
    mistakes=[
        Mistake(_FIT_SIG + "    return estimate.total <= free_bytes\n", "already in memory"),
        Mistake(_FIT_SIG + "    return estimate.activations <= free_bytes\n", "only the activations"),
        Mistake(_FIT_SIG + "    return (estimate.parameters + estimate.gradients + estimate.optimizer_state\n"
                "            + estimate.activations) <= free_bytes\n", "added up"),
        Mistake(_FIT_SIG + "    return estimate.total - estimate.parameters - estimate.batch < free_bytes\n",
                "use `<=`"),
        Mistake(_FIT_SIG + "    return estimate.total - estimate.parameters <= free_bytes  # the model is there\n",
                "the batch is already on the device too"),
        Mistake(_FIT_SIG + "    # the model, its optimizer and the batch are already on the device\n"
                "    existing = estimate.parameters + estimate.optimizer_state + estimate.batch\n"
                "    return estimate.total - existing <= free_bytes\n", "before the first step it does not exist yet"),
        Mistake(_FIT_SIG + "    existing = estimate.parameters + estimate.gradients + estimate.batch\n"
                "    return estimate.total - existing <= free_bytes\n", "before the first step there are none"),
    ],
))
