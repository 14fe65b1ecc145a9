"""Exercises of notebook 06, "Mixed precision".

06.1 read an autocast dtype table: which ops autocast lowers, which follow their input, which it keeps in
float32; 06.2 the share of gradient values that flush to zero in float16, scale first; 06.3 an fp16 training
step with a GradScaler, checked step by step against a reference (including an overflow that must be
skipped); 06.4 a context manager that sets the float32 matmul precision (TF32) and restores the previous
setting; 06.5 the smallest batch size from which autocast lowers the peak memory (claim 7), found with
the estimator and checked against a SimulatedGPU measurement.

Checkers build their models under `torch.random.fork_rng(devices=[])` with a fixed seed, run on the CPU
only, and restore any global setting they touch, so a check leaves the notebook's state as it was.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..amp import OpDtypes, underflow_fraction
from ..i18n import N_, _
from .core import (AnswerTimeout, Exercise, Incorrect, Mistake, NotAttempted, _short, as_float, call, describe, register,
                   require_function, seeded)
from .probe import observe

_LOW = (torch.bfloat16, torch.float16)


def _as_number(value: Any, label: str) -> float:
    if isinstance(value, torch.Tensor):
        raise Incorrect(_("{label} returned {value}: return a Python number (use .item() or float())").format(
            label=label, value=describe(value)))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Incorrect(_("{label} should return a number, got {value}").format(label=label, value=describe(value)))
    number = as_float(value)  # None for an int beyond float's range
    if number is None or not math.isfinite(number):
        raise Incorrect(_("{label} returned {value}; expected a finite number").format(label=label,
                                                                                    value=_short(value)))
    return number


# --- 06.1 reading the autocast table ---------------------------------------------------------------

_ROLES = ("lowers", "follows", "float32", "refused")


def _reference_roles(table: dict[str, OpDtypes]) -> dict[str, str]:
    roles = {}
    for name, (from_fp32, from_low) in table.items():
        if from_fp32 is None or from_low is None:
            roles[name] = "refused"
        elif from_fp32 in _LOW:
            roles[name] = "lowers"
        elif from_low in _LOW:
            roles[name] = "follows"
        else:
            roles[name] = "float32"
    return roles


def _table(low: torch.dtype, lowers: list[str], follows: list[str], fp32: list[str],
           refused: tuple[str, ...] = ()) -> dict[str, OpDtypes]:
    f32 = torch.float32
    table = {}
    for name in lowers:
        table[name] = OpDtypes(low, low)
    for name in follows:
        table[name] = OpDtypes(f32, low)
    for name in fp32:
        table[name] = OpDtypes(f32, f32)
    for name in refused:
        table[name] = OpDtypes(None, low) if len(table) % 2 else OpDtypes(f32, None)
    return table


def _check_tables() -> list[tuple[str, dict[str, OpDtypes]]]:
    """Tables shaped like those autocast_dtype_table measures: CPU in bf16, CUDA in fp16, one with refusals."""
    return [
        (N_("a CPU-like bfloat16 table"), _table(torch.bfloat16, ["matmul", "linear", "conv2d"],
                                             ["relu", "max_pool2d", "add", "exp", "softmax", "layer_norm"],
                                             ["cross_entropy", "mse_loss"])),
        (N_("a CUDA-like float16 table"), _table(torch.float16, ["matmul", "linear", "conv2d"],
                                             ["relu", "max_pool2d", "add"],
                                             ["exp", "softmax", "log_softmax", "layer_norm", "sum",
                                              "cross_entropy"])),
        (N_("a table where some ops refused an input (None)"), _table(torch.bfloat16, ["linear"], ["relu"],
                                                                      ["mse_loss"], refused=("fft_r2c", "cholesky"))),
    ]


def _roles_of(autocast_roles, table) -> tuple[bool, Any]:
    """In the learner's process: (True, its (key, role) pairs) when autocast_roles(table) gives a dict, else
    (False, what it gave)."""
    out = call(autocast_roles, table, name="autocast_roles")
    return (True, list(out.items())) if isinstance(out, dict) else (False, out)


def _check_autocast_roles(autocast_roles):
    observe(lambda: require_function(autocast_roles, "autocast_roles"))
    for label, table in _check_tables():
        label = _(label)
        is_dict, got = observe(lambda: _roles_of(autocast_roles, table))
        if not is_dict:
            raise Incorrect(_("autocast_roles should return a dict {{op name: role}}, got {value}").format(
                value=describe(got)))
        keys = [k for k, _v in got]
        if not all(type(k) is str for k in keys) or set(keys) != set(table):  # a key that is no str is no op name
            raise Incorrect(_("for {label}, the keys should be the op names of the table {names}, "
                              "got {keys}").format(label=label, names=sorted(table), keys=sorted(map(str, keys))))
        got = dict(got)
        bad = {k: v for k, v in got.items() if v not in _ROLES}
        if bad:
            raise Incorrect(_("roles must be one of {roles}, got {bad}").format(roles=_ROLES, bad=bad))
        expected = _reference_roles(table)
        wrong = {k: (got[k], expected[k]) for k in table if got[k] != expected[k]}
        if not wrong:
            continue
        shown = ", ".join(_("{op}: {got!r} (expected {expected!r})").format(op=k, got=g, expected=e)
                          for k, (g, e) in sorted(wrong.items()))
        if any(e == "refused" for _g, e in wrong.values()):
            raise Incorrect(_("for {label}: {shown}: likely mistake: a None entry means the op refused that input "
                              "on this device; classify it as 'refused' before looking at dtypes").format(
                label=label, shown=shown))
        if table["linear"].from_fp32 == torch.float16 and any(e == "lowers" for _g, e in wrong.values()):
            raise Incorrect(_("for {label}: {shown}: likely mistake: only torch.bfloat16 was treated as low "
                              "precision; autocast uses torch.float16 on older GPUs and Apple MPS: count both").format(
                label=label, shown=shown))
        if all(e == "lowers" and g == "follows" for g, e in wrong.values()):
            raise Incorrect(_("for {label}: {shown}: likely mistake: 'follows' was decided before 'lowers' (from_low "
                              "read first); an op that lowers also gives 16 bits for 16-bit inputs, so look at "
                              "from_fp32 first: only an op that keeps float32 inputs in float32 can "
                              "'follow'").format(label=label, shown=shown))
        if any(e == "follows" and g == "float32" for g, e in wrong.values()):
            raise Incorrect(_("for {label}: {shown}: likely mistake: only from_fp32 was read; an op that returns "
                              "float32 for float32 inputs still runs in low precision when it is fed low-precision "
                              "activations (from_low): that op 'follows' its input").format(label=label, shown=shown))
        raise Incorrect(_("for {label}: {shown}").format(label=label, shown=shown))
    return _("lowers: matmul/linear/conv run in 16 bits even from float32 inputs; follows: elementwise ops and "
             "pooling keep whatever dtype they get; float32: losses (and on CUDA softmax, exp, norms) are "
             "pinned to float32")


_ROLES_DOC = '    """{op name: "lowers" | "follows" | "float32" | "refused"} for an autocast_dtype_table."""\n'

register(Exercise(
    id="06.1", title=N_("Read the autocast table"), answer="autocast_roles",
    blank="def autocast_roles(table):\n" + _ROLES_DOC + "    raise NotImplementedError  # your code here\n",
    solution=("def autocast_roles(table):\n" + _ROLES_DOC
              + "    low = (torch.bfloat16, torch.float16)\n"
                "    roles = {}\n"
                "    for name, (from_fp32, from_low) in table.items():\n"
                "        if from_fp32 is None or from_low is None:\n"
                "            roles[name] = \"refused\"\n"
                "        elif from_fp32 in low:\n"
                "            roles[name] = \"lowers\"     # autocast casts its float32 inputs down\n"
                "        elif from_low in low:\n"
                "            roles[name] = \"follows\"    # runs in whatever dtype it is given\n"
                "        else:\n"
                "            roles[name] = \"float32\"    # autocast casts low-precision inputs up\n"
                "    return roles\n"),
    setup="import torch\nfrom course_utils.amp import OpDtypes\n",
    checker=_check_autocast_roles,
    hints=[N_("Each entry is OpDtypes(from_fp32, from_low): the output dtype for float32 inputs and for "
              "low-precision inputs. Check for None first."),
           N_("Low precision means torch.bfloat16 or torch.float16. 'lowers': from_fp32 is low. 'follows': from_fp32 "
              "is float32 but from_low is low. 'float32': both are float32.")],
    mistakes=[
        Mistake("def autocast_roles(table):\n"
                "    return {name: (\"lowers\" if d.from_fp32 in (torch.bfloat16, torch.float16) else \"float32\")\n"
                "            for name, d in table.items() if None not in d} | "
                "{name: \"refused\" for name, d in table.items() if None in d}\n", "only from_fp32 was read"),
        Mistake("def autocast_roles(table):\n"
                "    roles = {}\n"
                "    for name, (a, b) in table.items():\n"
                "        if a is None or b is None:\n"
                "            roles[name] = \"refused\"\n"
                "        elif a == torch.bfloat16:\n"
                "            roles[name] = \"lowers\"\n"
                "        elif b == torch.bfloat16:\n"
                "            roles[name] = \"follows\"\n"
                "        else:\n"
                "            roles[name] = \"float32\"\n"
                "    return roles\n", "only torch.bfloat16 was treated as low"),
        Mistake("def autocast_roles(table):\n"
                "    low = (torch.bfloat16, torch.float16)\n"
                "    return {name: \"lowers\" if a in low else \"follows\" if b in low else \"float32\"\n"
                "            for name, (a, b) in table.items()}\n", "refused that input"),
        Mistake("def autocast_roles(table):\n"
                "    low = (torch.bfloat16, torch.float16)\n"
                "    roles = {}\n"
                "    for name, (from_fp32, from_low) in table.items():\n"
                "        if from_fp32 is None or from_low is None:\n"
                "            roles[name] = \"refused\"\n"
                "        elif from_low in low:\n"
                "            roles[name] = \"follows\"  # 16-bit in, 16-bit out\n"
                "        elif from_fp32 in low:\n"
                "            roles[name] = \"lowers\"\n"
                "        else:\n"
                "            roles[name] = \"float32\"\n"
                "    return roles\n", "'follows' was decided before 'lowers'"),
        Mistake("def autocast_roles(table):\n"
                "    low = (torch.bfloat16, torch.float16)\n"
                "    roles = {}\n"
                "    for name, (from_fp32, from_low) in table.items():\n"
                "        if from_fp32 is None:  # the op refused float32 inputs\n"
                "            roles[name] = \"refused\"\n"
                "        elif from_fp32 in low:\n"
                "            roles[name] = \"lowers\"\n"
                "        elif from_low in low:\n"
                "            roles[name] = \"follows\"\n"
                "        else:\n"
                "            roles[name] = \"float32\"\n"
                "    return roles\n", "a None entry means the op refused that input"),
    ],
))


# --- 06.2 gradient values that flush to zero -------------------------------------------------------

def _gradient_like() -> torch.Tensor:
    """Magnitudes spread evenly over 1e-12 .. 1 (log scale), random signs, and a block of exact zeros."""
    with seeded(6):
        mags = torch.logspace(-12, 0, 1200)
        signs = torch.where(torch.rand(1200) < 0.5, -1.0, 1.0)
        values = torch.cat([mags * signs, torch.zeros(600)])
        return values[torch.randperm(len(values))]


def _check_flushed_fraction(flushed_fraction):
    observe(lambda: require_function(flushed_fraction, "flushed_fraction"))
    grads = _gradient_like()
    nonzero = int((grads != 0).sum())
    for scale in (1.0, 2.0 ** 10, 2.0 ** 16):
        expected = underflow_fraction(grads, torch.float16, scale=scale)  # course_utils.amp as the oracle
        got = _as_number(observe(lambda: call(flushed_fraction, grads.clone(), scale, name="flushed_fraction")),
                         f"flushed_fraction(grads, {scale:g})")
        if abs(got - expected) <= 1e-6:  # float32 arithmetic is fine
            continue
        lost = expected * nonzero
        unscaled = underflow_fraction(grads, torch.float16)
        label = _("flushed_fraction(grads, scale={scale:g}) returned {got:.4f}, expected {expected:.4f}").format(
            scale=scale, got=got, expected=expected)
        if abs(got - lost / grads.numel()) <= 1e-6 or abs(got - (lost + grads.numel() - nonzero) / grads.numel()) <= 1e-6:
            raise Incorrect(_("{label}: likely mistake: the values that were zero to begin with were counted (or "
                              "divided by); count only the nonzero values, and among them those that become 0").format(
                label=label))
        if scale > 1 and abs(got - unscaled) <= 1e-6:
            raise Incorrect(_("{label}: likely mistake: cast to float16 before multiplying by the scale (or the "
                              "scale was ignored): values that already flushed to 0 stay 0; multiply in float32 "
                              "first, then cast").format(label=label))
        if got == 0.0 and expected > 0:
            raise Incorrect(_("{label}: likely mistake: nothing flushed, as with bfloat16, which keeps float32's "
                              "range; the question is about torch.float16").format(label=label))
        scaled = grads * scale
        below = lambda values, limit: int(((values != 0) & (values < limit)).sum()) / nonzero  # noqa: E731
        tiny = torch.finfo(torch.float16).tiny
        if abs(got - below(scaled.abs(), tiny)) <= 1e-6:
            raise Incorrect(_("{label}: likely mistake: the values below float16's smallest normal number "
                              "(torch.finfo(torch.float16).tiny, about 6.1e-05) were counted as flushed, but float16 "
                              "keeps subnormal values down to about 6e-08; cast and compare instead: x.half() == "
                              "0").format(label=label))
        if abs(got - below(scaled.abs(), 2.0 ** -24)) <= 1e-6:
            raise Incorrect(_("{label}: likely mistake: the values below float16's smallest subnormal (2**-24, about "
                              "6e-08) were counted as flushed, but those from half of it up round to it, not to 0; "
                              "cast and compare instead: x.half() == 0").format(label=label))
        if any(abs(got - below(scaled, limit)) <= 1e-6 for limit in (2.0 ** -25, 2.0 ** -24, tiny)):
            raise Incorrect(_("{label}: likely mistake: every negative value was counted as flushed, since x < "
                              "threshold holds for all of them; compare magnitudes (x.abs()), or cast and test "
                              "x.half() == 0").format(label=label))
        raise Incorrect(label)
    zeros = torch.zeros(5)
    got = observe(lambda: call(flushed_fraction, zeros, 1.0, name="flushed_fraction"))
    if isinstance(got, torch.Tensor) or isinstance(got, bool) or not isinstance(got, (int, float)) or got != 0:
        raise Incorrect(_("for an all-zero tensor (no nonzero value at all) the answer should be 0.0, got "
                          "{value}: guard the division").format(value=describe(got)))
    return _("scaled by 2**16, every value of this spread survives the cast to float16")


_FLUSH_SIG = ("def flushed_fraction(grads, scale=1.0):\n"
              "    \"\"\"Of the nonzero values in `grads`, the fraction that become 0 in float16 after multiplying by\n"
              "    `scale` (a Python float; 0.0 when there is no nonzero value).\"\"\"\n")

register(Exercise(
    id="06.2", title=N_("How many gradients flush to zero?"), answer="flushed_fraction",
    blank=_FLUSH_SIG + "    raise NotImplementedError  # your code here\n",
    solution=(_FLUSH_SIG
              + "    scaled = grads.float() * scale            # scale first, in float32\n"
                "    nonzero = scaled != 0\n"
                "    flushed = nonzero & (scaled.half() == 0)  # then see what float16 makes of it\n"
                "    n = int(nonzero.sum())\n"
                "    return int(flushed.sum()) / n if n else 0.0\n"),
    setup="import torch\n",
    checker=_check_flushed_fraction,
    inside=N_("whether the answer changed its argument in place, seen while it ran"),
    hints=[N_("Multiply in float32 first, then cast with .half(): a value that became 0 in float16 cannot be "
              "brought back by scaling afterwards."),
           N_("Count only values that were nonzero before the cast: (x != 0) & (x.half() == 0). Return a Python "
              "float: int(tensor.sum()) divides like any number.")],
    mistakes=[
        Mistake(_FLUSH_SIG + "    h = grads.half() * scale\n    nz = grads != 0\n"
                "    return float((nz & (h == 0)).sum() / max(int(nz.sum()), 1))\n", "cast to float16 before"),
        Mistake(_FLUSH_SIG + "    return float(((grads * scale).half() == 0).float().mean())\n",
                "zero to begin with"),
        Mistake(_FLUSH_SIG + "    x = grads * scale\n    nz = x != 0\n"
                "    return float((nz & (x.bfloat16() == 0)).sum() / max(int(nz.sum()), 1))\n", "bfloat16"),
        Mistake(_FLUSH_SIG + "    grads *= scale  # scale first\n    nonzero = grads != 0\n"
                "    n = int(nonzero.sum())\n"
                "    return int((nonzero & (grads.half() == 0)).sum()) / n if n else 0.0\n", "changed its argument"),
        Mistake(_FLUSH_SIG + "    x = grads * scale\n    nonzero = x != 0\n"
                "    flushed = nonzero & (x.abs() < torch.finfo(torch.float16).tiny)  # below float16's smallest\n"
                "    n = int(nonzero.sum())\n    return int(flushed.sum()) / n if n else 0.0\n", "smallest normal"),
        Mistake(_FLUSH_SIG + "    x = grads * scale\n    nonzero = x != 0\n"
                "    flushed = nonzero & (x < 2 ** -24)  # float16's smallest subnormal\n"
                "    n = int(nonzero.sum())\n    return int(flushed.sum()) / n if n else 0.0\n",
                "every negative value was counted"),
    ],
))


# --- 06.3 an fp16 step with a GradScaler -----------------------------------------------------------

def _tiny_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _reference_step(model, optimizer, scaler, x, y) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    with torch.amp.autocast(x.device.type, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _run_learner_step(fp16_step, model, optimizer, scaler, x, y) -> tuple[Any, torch.dtype | None]:
    """In the learner's process: fp16_step(model, optimizer, scaler, x, y) with its errors explained; returns what
    it returned and the dtype the first Linear layer produced (None if the model never ran)."""
    first = model[0]
    seen: list[torch.dtype] = []
    handle = first.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    stepped: list[int] = []  # optimizer.step() calls, directly or through scaler.step
    step_handle = optimizer.register_step_pre_hook(lambda opt, args, kwargs: stepped.append(1))
    try:
        out = call(fp16_step, model, optimizer, scaler, x, y, name="fp16_step", check_mutation=False)
    except Incorrect as exc:
        text = str(exc)
        # the arguments' reprs are long: name them (a replace, not a parse, so it works in any language)
        long_call = "fp16_step(" + ", ".join(_short(a) for a in (model, optimizer, scaler, x, y)) + ")"
        text = text.replace(long_call, "fp16_step(model, optimizer, scaler, x, y)")
        if "_scale is None" in text or "scaler.scale(" in text:
            raise Incorrect(_("{text}: likely mistake: loss.backward() without scaler.scale(loss): the scaler has "
                              "nothing to unscale; call scaler.scale(loss).backward()").format(text=text)) from None
        if "prior to update" in text and not stepped:
            raise Incorrect(_("{text}: likely mistake: scaler.update() ran before scaler.step(optimizer); update() "
                              "reads what step() found (inf/nan or not), so the order is scaler.step(optimizer), "
                              "then scaler.update()").format(text=text)) from None
        if "No inf checks were recorded" in text:
            raise Incorrect(_("{text}: likely mistake: optimizer.step() was called directly, so the scaled gradients "
                              "were applied and the scaler never checked them; call scaler.step(optimizer), which "
                              "unscales first (and skips the step on inf/nan)").format(text=text)) from None
        if "since the last update" in text:
            raise Incorrect(_("{text}: likely mistake: scaler.update() was not called after scaler.step(optimizer); "
                              "without it the scale never adapts and the next step() refuses to run").format(
                text=text)) from None
        raise Incorrect(text) from None
    finally:
        handle.remove()
        step_handle.remove()
    return out, (seen[0] if seen else None)


def _observed_step(fp16_step, model, optimizer, scaler, x, y, label: str) -> tuple[list, float, Any, list, float]:
    """One learner step, run where the answer lives: the weights and the scale before, what fp16_step returned,
    the weights and the scale after (the first layer's dtype is judged here). The batch goes in as a copy, so that
    the checker's own x and y stay as they were for the reference."""
    def run():
        before, scale_before = _params(model), scaler.get_scale()
        out, first_dtype = _run_learner_step(fp16_step, model, optimizer, scaler, x.clone(), y.clone())
        return before, scale_before, out, first_dtype, _params(model), scaler.get_scale()

    before, scale_before, out, first_dtype, after, scale_after = observe(run)
    if first_dtype is not None and first_dtype != torch.float16:
        which = "bfloat16" if first_dtype == torch.bfloat16 else str(first_dtype).removeprefix("torch.")
        raise Incorrect(_("{label}: the first Linear layer produced {which}, expected float16: wrap the forward "
                          "pass and the loss in torch.amp.autocast(x.device.type, dtype=torch.float16)").format(
            label=label, which=which))
    return before, scale_before, out, after, scale_after


def _check_fp16_step(fp16_step):
    observe(lambda: require_function(fp16_step, "fp16_step"))
    with seeded(3):
        base = _tiny_model()
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        x2, y2 = torch.randn(8, 6), torch.randint(0, 3, (8,))
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=1000) for _ in "ab")

    # model, opt and scaler are handed to the learner's code: read only through _observed_step
    for k, (xb, yb) in enumerate([(x, y), (x2, y2)], 1):
        before, _scale_before, out, after, scale = _observed_step(fp16_step, model, opt, scaler, xb, yb,
                                                                  _("step {k}").format(k=k))
        ref_before = _params(ref)
        ref_loss = _reference_step(ref, ref_opt, ref_scaler, xb, yb)
        if not isinstance(out, torch.Tensor) or out.numel() != 1 or out.is_complex() or out.device.type == "meta":
            raise Incorrect(_("fp16_step should return the loss, a 0-d tensor, got {value}").format(
                value=describe(out)))
        if out.requires_grad:
            raise Incorrect(_("fp16_step returned a loss that still holds the autograd graph: return loss.detach()"))
        if not torch.allclose(out.float(), ref_loss.float(), rtol=1e-3, atol=1e-4):
            if torch.allclose(out.float(), ref_loss.float() * scale, rtol=1e-3) or \
                    torch.allclose(out.float(), ref_loss.float() * ref_scaler.get_scale(), rtol=1e-3):
                raise Incorrect(_("step {k} returned a loss of {loss:.5f}, the cross-entropy {expected:.5f} times "
                                  "the scale: likely mistake: the scaled loss was returned; keep the loss itself, "
                                  "call backward on scaler.scale(loss), and return loss.detach()").format(
                    k=k, loss=float(out), expected=float(ref_loss)))
            raise Incorrect(_("step {k} returned a loss of {loss:.5f}; cross-entropy of the batch under float16 "
                              "autocast is {expected:.5f}").format(k=k, loss=float(out), expected=float(ref_loss)))
        for p, q, p0, q0 in zip(after, ref.parameters(), before, ref_before):
            if torch.allclose(p, q, rtol=1e-4, atol=1e-6):
                continue
            if out.dtype == torch.float16:
                raise Incorrect(_("step {k}: the loss is float16 and the weights differ from the reference: likely "
                                  "mistake: the loss was computed after the autocast block, on its float16 output; "
                                  "compute it inside the block, where autocast runs cross_entropy in "
                                  "float32").format(k=k))
            moved, ref_moved = (p.detach() - p0).norm(), (q.detach() - q0).norm()
            if ref_moved > 0 and moved / ref_moved > 100:
                raise Incorrect(_("step {k} moved the weights {ratio:.0f}x too far: likely "
                                  "mistake: optimizer.step() used the scaled gradients; call scaler.step(optimizer), "
                                  "which unscales them first (and skips the step on inf/nan)").format(
                    k=k, ratio=float(moved / ref_moved)))
            if k == 2:
                raise Incorrect(_("step 1 matched the reference but step 2 did not: likely mistake: the gradients of "
                                  "step 1 were still there; call optimizer.zero_grad() at the start of each step"))
            raise Incorrect(_("after step {k} the weights differ from a reference fp16 step with loss scaling").format(
                k=k))
        if scale != ref_scaler.get_scale():
            raise Incorrect(_("after step {k} the scale is {scale:g}, expected {expected:g}").format(
                k=k, scale=scale, expected=ref_scaler.get_scale()))

    bad = x.clone()
    bad[0, 0] = float("inf")  # a batch that overflows: its gradients are inf/nan, so the step must be skipped
    before, scale_before, _out, after, scale = _observed_step(fp16_step, model, opt, scaler, bad, y,
                                                              _("the overflow step"))
    if not all(torch.isfinite(p).all() for p in after):
        raise Incorrect(_("a batch with an inf made the weights inf/nan: likely mistake: the step was not skipped; "
                          "scaler.step(optimizer) checks the gradients and skips optimizer.step() on inf/nan"))
    if not all(torch.equal(a, b) for a, b in zip(before, after)):
        raise Incorrect(_("a batch whose gradients overflow changed the weights; that step should be skipped "
                          "(scaler.step(optimizer) does it)"))
    if scale == scale_before:
        raise Incorrect(_("after an overflow the scale is still {scale:g}: likely mistake: scaler.update() "
                          "was not called; it halves the scale after a skipped step").format(scale=scale_before))
    if scale != scale_before / 2:
        raise Incorrect(_("after an overflow the scale went from {before:g} to {after:g}; "
                          "GradScaler halves it").format(before=scale_before, after=scale))
    return _("two steps match the reference, and the overflow step was skipped with the scale halved")


_STEP_SIG = ("def fp16_step(model, optimizer, scaler, x, y):\n"
             "    \"\"\"One training step in float16 autocast with loss scaling; returns the loss, detached.\"\"\"\n")

register(Exercise(
    id="06.3", title=N_("An fp16 step with a GradScaler"), answer="fp16_step",
    blank=_STEP_SIG + "    raise NotImplementedError  # your code here\n",
    solution=(_STEP_SIG
              + "    optimizer.zero_grad(set_to_none=True)\n"
                "    with torch.amp.autocast(x.device.type, dtype=torch.float16):\n"
                "        loss = F.cross_entropy(model(x), y)\n"
                "    scaler.scale(loss).backward()  # gradients of loss * scale: small values survive float16\n"
                "    scaler.step(optimizer)         # unscales; skips optimizer.step() if any gradient is inf/nan\n"
                "    scaler.update()                # halves the scale after a skip, grows it after a good run\n"
                "    return loss.detach()\n"),
    setup="import torch\nimport torch.nn.functional as F\n",
    checker=_check_fp16_step,
    inside=N_("the dtype the first layer produced, seen by a hook while the answer ran"),
    hints=[N_("Four parts: zero the gradients; forward and loss inside torch.amp.autocast(x.device.type, "
              "dtype=torch.float16); backward of the scaled loss; step and update through the scaler."),
           N_("scaler.scale(loss).backward(), then scaler.step(optimizer) (not optimizer.step()), then "
              "scaler.update().")],
    mistakes=[
        Mistake(_STEP_SIG + "    optimizer.zero_grad()\n"
                "    with torch.amp.autocast(x.device.type, dtype=torch.float16):\n"
                "        loss = F.cross_entropy(model(x), y)\n"
                "    scaler.scale(loss).backward()\n    optimizer.step()\n    scaler.update()\n"
                "    return loss.detach()\n", "scaled gradients"),
        Mistake(_STEP_SIG + "    optimizer.zero_grad()\n"
                "    with torch.amp.autocast(x.device.type, dtype=torch.float16):\n"
                "        loss = F.cross_entropy(model(x), y)\n"
                "    scaler.scale(loss).backward()\n    scaler.step(optimizer)\n"
                "    return loss.detach()\n", "scaler.update() was not called"),
        Mistake(_STEP_SIG + "    optimizer.zero_grad()\n"
                "    with torch.amp.autocast(x.device.type, dtype=torch.float16):\n"
                "        loss = F.cross_entropy(model(x), y)\n"
                "    loss.backward()\n    scaler.step(optimizer)\n    scaler.update()\n"
                "    return loss.detach()\n", "without scaler.scale(loss)"),
        Mistake(_STEP_SIG + "    with torch.amp.autocast(x.device.type, dtype=torch.float16):\n"
                "        loss = F.cross_entropy(model(x), y)\n"
                "    scaler.scale(loss).backward()\n    scaler.step(optimizer)\n    scaler.update()\n"
                "    return loss.detach()\n", "zero_grad()"),
        Mistake(_STEP_SIG + "    optimizer.zero_grad()\n"
                "    with torch.amp.autocast(x.device.type, dtype=torch.bfloat16):\n"
                "        loss = F.cross_entropy(model(x), y)\n"
                "    scaler.scale(loss).backward()\n    scaler.step(optimizer)\n    scaler.update()\n"
                "    return loss.detach()\n", "produced bfloat16"),
        Mistake(_STEP_SIG + "    optimizer.zero_grad()\n"
                "    with torch.amp.autocast(x.device.type, dtype=torch.float16):\n"
                "        loss = F.cross_entropy(model(x), y)\n"
                "    scaler.scale(loss).backward()\n    scaler.update()  # adapt the scale first\n"
                "    scaler.step(optimizer)\n    return loss.detach()\n", "scaler.update() ran before"),
        Mistake(_STEP_SIG + "    optimizer.zero_grad()\n"
                "    with torch.amp.autocast(x.device.type, dtype=torch.float16):\n"
                "        loss = scaler.scale(F.cross_entropy(model(x), y))\n"
                "    loss.backward()\n    scaler.step(optimizer)\n    scaler.update()\n"
                "    return loss.detach()\n", "the scaled loss was returned"),
        Mistake(_STEP_SIG + "    optimizer.zero_grad()\n"
                "    with torch.amp.autocast(x.device.type, dtype=torch.float16):\n"
                "        logits = model(x)\n"
                "    loss = F.cross_entropy(logits, y)\n"
                "    scaler.scale(loss).backward()\n    scaler.step(optimizer)\n    scaler.update()\n"
                "    return loss.detach()\n", "computed after the autocast block"),
    ],
))


# --- 06.4 the float32 matmul precision, set and restored -------------------------------------------

class _Probe(Exception):
    """Raised inside the learner's with-block to see whether the setting is restored on the way out."""


def _precision() -> str:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError as exc:  # torch >= 2.9: the new fp32_precision API was used, the old getter refuses
        raise Incorrect(_("torch.get_float32_matmul_precision() now raises ({error}): likely "
                          "mistake: the new torch.backends...fp32_precision settings were mixed with "
                          "set_float32_matmul_precision; use set_float32_matmul_precision only").format(
            error=str(exc).split(',')[0])) from None


def _enter(cm: Any, label: str, probe: bool) -> str | None:
    """Run `with cm:` (raising _Probe inside when `probe`); returns the precision seen inside."""
    if not (hasattr(type(cm), "__enter__") and hasattr(type(cm), "__exit__")):
        raise Incorrect(_("{label} should return a context manager (usable in a `with` statement), got "
                          "{value}: likely mistake: a plain function; decorate a generator with "
                          "@contextlib.contextmanager").format(label=label, value=describe(cm)))
    inside = None
    try:
        with cm:
            inside = _precision()
            if probe:
                raise _Probe()
    except _Probe:
        return inside
    except NotImplementedError:
        raise NotAttempted() from None
    except (AnswerTimeout, KeyboardInterrupt, Incorrect):
        raise
    except Exception as exc:
        raise Incorrect(_("`with {label}:` raised {error}: {message}").format(
            label=label, error=type(exc).__name__, message=exc)) from None
    if probe:
        raise Incorrect(_("an exception raised inside `with {label}:` did not come out: the context manager "
                          "swallowed it; let exceptions propagate (do not return True from __exit__ or catch "
                          "around the yield)").format(label=label))
    return inside


def _precision_around(matmul_precision, before: str, precision: str, probe: bool) -> tuple[str | None, str]:
    """In the learner's process (the setting is global there): with the precision at `before`, run
    `with matmul_precision(precision):` (raising inside when `probe`); returns the precision seen inside the block
    and the one after it. The setting in force before the check is put back."""
    try:
        original = torch.get_float32_matmul_precision()
    except RuntimeError:
        original = "highest"
    try:
        torch.set_float32_matmul_precision(before)
        cm = call(matmul_precision, precision, name="matmul_precision")
        inside = _enter(cm, f"matmul_precision({precision!r})", probe=probe)
        return inside, _precision()
    finally:
        torch.set_float32_matmul_precision(original)


def _check_matmul_precision(matmul_precision):
    observe(lambda: require_function(matmul_precision, "matmul_precision"))
    # "high" before: not the default, so "restore the default" shows up
    inside, after = observe(lambda: _precision_around(matmul_precision, "high", "medium", probe=False))
    if inside != "medium":
        raise Incorrect(_("inside `with matmul_precision('medium'):` the precision was {inside!r}, expected "
                          "'medium'").format(inside=inside))
    # the same with a block that raises, before judging the first: the two together tell the causes apart
    _inside, after_raise = observe(lambda: _precision_around(matmul_precision, "highest", "high", probe=True))
    if after == "medium" and after_raise == "highest":
        raise Incorrect(_("after the block the precision is still 'medium', expected 'high' (the setting "
                          "before); it is put back only when the block raises: likely mistake: the restore is "
                          "in an except clause; put it in a finally, which runs on both ways out"))
    if after == "medium":
        raise Incorrect(_("after the block the precision is still 'medium', expected 'high' (the setting "
                          "before): likely mistake: nothing was put back, or the value put back was read after "
                          "setting the new one; read torch.get_float32_matmul_precision() before "
                          "torch.set_float32_matmul_precision(precision), and set it back in a finally"))
    if after != "high":
        if after == "highest":
            raise Incorrect(_("after the block the precision is {after!r}, expected 'high' (the setting before): "
                              "likely mistake: restored 'highest' (the default) instead of the setting in force "
                              "before the block ('high'); read it with torch.get_float32_matmul_precision() "
                              "first").format(after=after))
        raise Incorrect(_("after the block the precision is {after!r}, expected 'high' (the setting "
                          "before)").format(after=after))
    if after_raise != "highest":
        raise Incorrect(_("an exception inside the with block left the precision at {after!r} instead of "
                          "restoring 'highest': likely mistake: the restore is skipped when the block raises; "
                          "put it in a finally").format(after=after_raise))
    return _("set inside, the previous value back afterwards, even when the block raises")


_PREC_SIG = ("@contextlib.contextmanager\n"
             "def matmul_precision(precision):\n"
             "    \"\"\"Inside the with block, float32 matmuls use `precision`; afterwards the previous setting is "
             "back.\"\"\"\n")

register(Exercise(
    id="06.4", title=N_("TF32 for one block only"), answer="matmul_precision",
    blank=_PREC_SIG + "    raise NotImplementedError  # your code here\n",
    solution=(_PREC_SIG
              + "    previous = torch.get_float32_matmul_precision()\n"
                "    torch.set_float32_matmul_precision(precision)\n"
                "    try:\n"
                "        yield\n"
                "    finally:  # also when the block raises\n"
                "        torch.set_float32_matmul_precision(previous)\n"),
    setup="import contextlib\nimport torch\n",
    checker=_check_matmul_precision,
    inside=N_("torch's float32 matmul precision, read inside and after the answer's with block"),
    hints=[N_("Read the current value with torch.get_float32_matmul_precision() before changing it."),
           N_("In a @contextlib.contextmanager generator, the code after `yield` runs when the block ends; put it in "
              "`finally:` so that it also runs when the block raises.")],
    mistakes=[
        Mistake(_PREC_SIG + "    torch.set_float32_matmul_precision(precision)\n    try:\n        yield\n"
                "    finally:\n        torch.set_float32_matmul_precision(\"highest\")\n", "restored 'highest'"),
        Mistake(_PREC_SIG + "    previous = torch.get_float32_matmul_precision()\n"
                "    torch.set_float32_matmul_precision(precision)\n    yield\n"
                "    torch.set_float32_matmul_precision(previous)\n", "finally"),
        Mistake("def matmul_precision(precision):\n"
                "    \"\"\"Inside the with block, float32 matmuls use `precision`; afterwards the previous setting "
                "is back.\"\"\"\n    torch.set_float32_matmul_precision(precision)\n", "context manager"),
        Mistake(_PREC_SIG + "    torch.set_float32_matmul_precision(precision)\n"
                "    previous = torch.get_float32_matmul_precision()\n"
                "    try:\n        yield\n    finally:\n        torch.set_float32_matmul_precision(previous)\n",
                "read after setting the new one"),
        Mistake(_PREC_SIG + "    previous = torch.get_float32_matmul_precision()\n"
                "    torch.set_float32_matmul_precision(precision)\n"
                "    try:\n        yield\n    except Exception:\n"
                "        torch.set_float32_matmul_precision(previous)\n        raise\n",
                "it is put back only when the block raises"),
        Mistake(_PREC_SIG + "    previous = torch.get_float32_matmul_precision()\n"
                "    torch.set_float32_matmul_precision(precision)\n"
                "    try:\n        yield\n    except Exception:\n"
                "        pass  # an error in the block must not break the setting\n"
                "    finally:\n        torch.set_float32_matmul_precision(previous)\n",
                "swallowed it"),
    ],
))


# --- 06.5 from which batch size does autocast save memory? ----------------------------------------

_PEAK_BUDGET = 120  # peak() calls allowed: a bisection needs about 2 x log2(max_batch) = 24


class _Peaks:
    """peak(batch, amp=False): the predicted peak bytes of one training step, counted per call."""

    def __init__(self, fp32: Callable[[int], int], amp: Callable[[int], int]):
        self.fp32, self.amp = fp32, amp
        self.calls = 0
        self.cache: dict[tuple[int, bool], int] = {}

    def __call__(self, batch, amp=False):
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(_("peak() takes a batch size (an int >= 1), got {batch!r}").format(batch=batch))
        self.calls += 1
        if self.calls > _PEAK_BUDGET:
            raise _TooManyPeaks()
        key = (batch, bool(amp))
        if key not in self.cache:
            self.cache[key] = int((self.amp if amp else self.fp32)(batch))
        return self.cache[key]

    def saves(self, batch: int) -> bool:
        return self.amp(batch) < self.fp32(batch)


class _TooManyPeaks(Exception):
    pass


def _wide_mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The notebook's parameter-heavy model: three 1024-wide linear layers, plain SGD."""
    with seeded(0):
        net = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    return net, torch.optim.SGD(net.parameters(), lr=0.01)


def _estimated(net, opt, amp: bool) -> Callable[[int], int]:
    from ..memory import estimate_training_memory

    def peak(batch: int) -> int:
        example = (torch.zeros(batch, 1024), torch.zeros(batch, dtype=torch.long))
        return estimate_training_memory(net, opt, example, F.cross_entropy,
                                        autocast_dtype=torch.bfloat16 if amp else None).total
    return peak


def _measured_peaks(net, opt, batch: int) -> tuple[int, int]:
    """(float32, bfloat16 autocast) peak of one SGD step at `batch`, measured on a SimulatedGPU."""
    from ..memory import SimulatedGPU

    peaks = []
    for amp in (False, True):
        with seeded(1):
            x, y = torch.randn(batch, 1024), torch.randint(0, 10, (batch,))
        model, optimizer = copy.deepcopy((net, opt))
        with SimulatedGPU("64GiB", model=model, optimizer=optimizer) as gpu:
            gpu.track(x, y)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            peaks.append(gpu.max_memory_allocated())
    return peaks[0], peaks[1]


def _first_saving(peaks: _Peaks, max_batch: int) -> int | None:
    lo, hi = 1, max_batch
    if not peaks.saves(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if peaks.saves(mid) else (mid + 1, hi)
    return lo


def _check_break_even(amp_break_even):
    from ..memory import format_bytes

    observe(lambda: require_function(amp_break_even, "amp_break_even"))
    net, opt = _wide_mlp()
    scenarios = [
        # (what, fp32 peak, autocast peak, max_batch): the optimizer step sets both peaks for small batches,
        # then autocast's weight copies cost more, then its smaller activations win from batch 201
        (N_("a model where autocast first costs memory, then saves it"), lambda b: 1024 * max(5000, 1000 + 30 * b),
         lambda b: 1024 * max(5000, 3005 + 20 * b), 4096),
        (N_("a model whose optimizer step sets both peaks until float32's activations outgrow it"),
         lambda b: 1024 * max(5000, 1000 + 30 * b), lambda b: 1024 * max(5000, 500 + 20 * b), 4096),
        (N_("a model where autocast never saves memory"), lambda b: 1024 * (4000 + 10 * b),
         lambda b: 1024 * (6000 + 10 * b), 4096),
        # the edges of the range: a saving only at max_batch itself, and one from batch 1
        (N_("a model where autocast saves memory only at max_batch itself"), lambda b: 1024 * (1000 + 30 * b),
         lambda b: 1024 * (41950 + 20 * b), 4096),
        (N_("an image model whose activations dominate, where autocast saves from batch 1"),
         lambda b: 1024 * (1000 + 300 * b), lambda b: 1024 * (1100 + 150 * b), 4096),
        (N_("the wide MLP above (estimate_training_memory)"), _estimated(net, opt, False), _estimated(net, opt, True),
         4096),
    ]
    for what, fp32, amp, max_batch in scenarios:
        what = _(what)

        def run():  # peak() is counted where the answer calls it
            peaks = _Peaks(fp32, amp)
            try:
                return call(amp_break_even, peaks, max_batch, name="amp_break_even", check_mutation=False)
            except Incorrect:
                if peaks.calls <= _PEAK_BUDGET:
                    raise
                raise Incorrect(_("for {what}, amp_break_even asked for more than {budget} peaks: likely mistake: "
                                  "trying every batch size in turn; each peak is a training step run on fake "
                                  "tensors. The answer splits the sizes in two (smaller: no saving, larger: "
                                  "saving): bisect").format(what=what, budget=_PEAK_BUDGET)) from None

        got = observe(run)
        expected = _first_saving(_Peaks(fp32, amp), max_batch)
        if (got is None or type(got) is int) and got == expected:
            continue
        if got is not None and (isinstance(got, bool) or not isinstance(got, int)):
            raise Incorrect(_("amp_break_even should return a batch size (an int) or None, got {value}").format(
                value=describe(got)))
        shown = _("for {what}, amp_break_even returned {got!r}, expected {expected!r}").format(
            what=what, got=got, expected=expected)
        if expected is None:
            raise Incorrect(_("{shown}: at batch {batch} autocast's peak is {amp_peak}, float32's "
                              "{fp32_peak}: no batch up to max_batch saves memory, return None").format(
                shown=shown, batch=got, amp_peak=format_bytes(amp(got)), fp32_peak=format_bytes(fp32(got))))
        if got is None and expected == max_batch:
            raise Incorrect(_("{shown}: at max_batch = {batch} itself, autocast's peak ({amp_peak}) is below "
                              "float32's ({fp32_peak}): likely mistake: a search that ends at max_batch was taken "
                              "as finding nothing; max_batch is a size like any other: return None only when it "
                              "does not save either").format(
                shown=shown, batch=expected, amp_peak=format_bytes(amp(expected)),
                fp32_peak=format_bytes(fp32(expected))))
        if got is None:
            raise Incorrect(_("{shown}: from batch {batch}, autocast's peak ({amp_peak}) is "
                              "below float32's ({fp32_peak}): likely mistake: waiting for a large "
                              "saving ('nearly halves'); any saving counts").format(
                shown=shown, batch=expected, amp_peak=format_bytes(amp(expected)),
                fp32_peak=format_bytes(fp32(expected))))
        if not 1 <= got <= max_batch:
            raise Incorrect(_("{shown}: batch sizes run from 1 to max_batch = {max_batch}").format(
                shown=shown, max_batch=max_batch))
        if amp(got) == fp32(got):
            raise Incorrect(_("{shown}: at batch {batch} both peaks are {peak}: likely mistake: "
                              "<= instead of <; equal peaks are no saving").format(
                shown=shown, batch=got, peak=format_bytes(fp32(got))))
        if amp(got) > fp32(got):
            raise Incorrect(_("{shown}: at batch {batch} autocast's peak is still {excess} "
                              "above float32's: likely mistake: the search stops one step early (off by one)").format(
                shown=shown, batch=got, excess=format_bytes(amp(got) - fp32(got))))
        if expected == 1:
            raise Incorrect(_("{shown}: autocast already saves at batch 1, the smallest size: likely mistake: the "
                              "search never tests batch 1 itself (a bisection whose lower end is taken as not "
                              "saving); test it too").format(shown=shown))
        if got & (got - 1) == 0:
            raise Incorrect(_("{shown}: autocast already saves at batch {batch}: likely mistake: doubling the batch "
                              "overshoots; search between the last size without a saving and the first with "
                              "one").format(shown=shown, batch=expected))
        raise Incorrect(_("{shown}: autocast already saves at batch {batch}, below {got}: the search went past the "
                          "first size that saves; keep the smallest size found to save as the upper end").format(
            shown=shown, batch=expected, got=got))
    b = expected
    measured = {n: _measured_peaks(net, opt, n) for n in (b - 1, b)}
    agree = (measured[b - 1][1] >= measured[b - 1][0]) and (measured[b][1] < measured[b][0])

    def diff(n):
        fp32_peak, amp_peak = measured[n]
        sign = "+" if amp_peak >= fp32_peak else "-"
        return _("batch {batch}: bf16 {sign}{size} against float32").format(
            batch=n, sign=sign, size=format_bytes(abs(amp_peak - fp32_peak)))
    if agree:
        return _("the wide MLP saves from batch {batch}; measured on a SimulatedGPU, {below}, {at}").format(
            batch=b, below=diff(b - 1), at=diff(b))
    return _("the wide MLP saves from batch {batch}; measured on a SimulatedGPU, {below}, {at} (the measurement "
             "and the estimate disagree here: the estimator is off at this size)").format(
        batch=b, below=diff(b - 1), at=diff(b))


_BE_DOC = ("def amp_break_even(peak, max_batch=4096):\n"
           "    \"\"\"The smallest batch size (1 to max_batch) at which autocast's peak, peak(batch, amp=True), is\n"
           "    below float32's, peak(batch); None if there is none.\"\"\"\n")
_BE_SOLUTION = _BE_DOC + (
    "    def saves(batch):\n"
    "        return peak(batch, amp=True) < peak(batch)\n"
    "\n"
    "    if not saves(max_batch):\n"
    "        return None\n"
    "    lo, hi = 1, max_batch  # the answer is in [lo, hi]: saves(hi) holds\n"
    "    while lo < hi:\n"
    "        mid = (lo + hi) // 2\n"
    "        if saves(mid):\n"
    "            hi = mid\n"
    "        else:\n"
    "            lo = mid + 1\n"
    "    return lo\n")


def _be_variant(old: str, new: str) -> str:
    assert old in _BE_SOLUTION
    return _BE_SOLUTION.replace(old, new)


register(Exercise(
    id="06.5", title=N_("From which batch size does autocast save memory?"), answer="amp_break_even",
    blank=_BE_DOC + "    raise NotImplementedError  # your code here\n",
    solution=_BE_SOLUTION,
    setup="",
    checker=_check_break_even,
    inside=N_("the peak() calls, counted while the answer ran"),
    timeout=30.0,
    hints=[N_("Autocast's 16-bit weight copies cost a fixed amount; its smaller activations save an amount that "
              "grows with the batch. So there is a batch size below which it never saves and from which it always "
              "does."),
           N_("Each peak() call runs a training step on fake tensors: bisect between 1 and max_batch (about 24 calls), "
              "after checking that max_batch saves at all."),
           N_("Equal peaks are no saving: test peak(b, amp=True) < peak(b).")],
    mistakes=[
        Mistake(_BE_DOC + "    for batch in range(1, max_batch + 1):\n"
                "        if peak(batch, amp=True) < peak(batch):\n            return batch\n    return None\n",
                "bisect"),
        Mistake(_be_variant("peak(batch, amp=True) < peak(batch)", "peak(batch, amp=True) <= peak(batch)"),
                "<= instead of <"),
        Mistake(_be_variant("peak(batch, amp=True) < peak(batch)", "peak(batch, amp=True) < 0.55 * peak(batch)"),
                "any saving counts"),
        Mistake(_be_variant("    if not saves(max_batch):\n        return None\n", ""), "return None"),
        Mistake(_be_variant("            lo = mid + 1\n", "            lo = mid\n").replace(
            "    while lo < hi:\n", "    while hi - lo > 1:\n").replace("    return lo\n", "    return lo\n"),
                "off by one"),
        Mistake(_BE_DOC + "    batch = 1\n    while batch <= max_batch:\n"
                "        if peak(batch, amp=True) < peak(batch):\n            return batch\n"
                "        batch *= 2\n    return None\n", "doubling the batch overshoots"),
        Mistake(_be_variant("    if not saves(max_batch):\n        return None\n", "").replace(
            "    return lo\n", "    return lo if lo < max_batch else None  # the search ran to the end: none\n"),
                "a search that ends at max_batch"),
        Mistake(_be_variant("            lo = mid + 1\n", "            lo = mid\n").replace(
            "    while lo < hi:\n", "    while hi - lo > 1:  # lo: no saving, hi: saving\n").replace(
            "    return lo\n", "    return hi\n"), "the search never tests batch 1 itself"),
    ],
))
