"""Tests for course_utils.amp: dtype choice, the GradScaler rules, the step protocol, measurements.

Everything runs on the CPU for real (bf16 and fp16 autocast, a CPU GradScaler). Only the CUDA
capability answer and the GradScaler-internals fallback are faked, since neither can be staged here.
"""
from __future__ import annotations

import copy
import inspect
import io
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_utils import amp
from course_utils.amp import (MixedPrecision, OpDtypes, autocast, autocast_dtype_table, choose_dtype,
                              resolve_dtype, train_step, underflow_fraction)
from course_utils.data import synthetic_digits
from course_utils.models import SimpleCNN
from course_utils.step import TrainStep

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks behaviour on a machine without CUDA")


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def tiny_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# --- dtype choice ------------------------------------------------------------------------

def test_cpu_chooses_bfloat16():
    assert choose_dtype("cpu") == torch.bfloat16
    assert choose_dtype(torch.device("cpu")) == torch.bfloat16


@pytest.mark.parametrize("native, emulated, expected", [
    (True, True, torch.bfloat16),    # Ampere and newer
    (False, True, torch.float16),    # Turing/Volta: bf16 only by emulation, which must not count
    (False, False, torch.float16),
])
def test_cuda_choice_follows_native_bf16_support(monkeypatch, native, emulated, expected):
    asked = []

    def fake_is_bf16_supported(including_emulation: bool = True) -> bool:
        asked.append(including_emulation)
        return native or (including_emulation and emulated)

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", fake_is_bf16_supported)
    assert choose_dtype("cuda") == expected
    assert asked == [False]


def test_mps_chooses_float16():
    assert choose_dtype("mps") == torch.float16


def test_unknown_device_type_has_no_automatic_dtype():
    with pytest.raises(ValueError, match="pass dtype"):
        choose_dtype("meta")
    with pytest.raises(ValueError, match="not a device name"):
        choose_dtype("gpu0")
    with pytest.raises(TypeError):
        choose_dtype(3)


def test_resolve_dtype_names_and_bad_input():
    assert resolve_dtype("cpu", "auto") == choose_dtype("cpu")
    assert resolve_dtype("cpu", "fp16") == torch.float16
    assert resolve_dtype("cpu", "torch.bfloat16") == torch.bfloat16
    assert resolve_dtype("cpu", torch.float32) == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("cpu", "fp8")
    with pytest.raises(ValueError, match="bfloat16 or torch.float16"):
        resolve_dtype("cpu", torch.int8)


@no_cuda
def test_cuda_device_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        MixedPrecision("cuda")
    with pytest.raises(ValueError, match="CUDA is not available"):
        autocast("cuda", "fp16")


def test_autocast_function_casts_matmuls_and_float32_is_a_no_op():
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    with autocast("cpu"):
        assert F.linear(x, w).dtype == choose_dtype("cpu")
    with autocast("cpu", "fp16"):
        assert F.linear(x, w).dtype == torch.float16
    with autocast("cpu", "fp32"):
        assert F.linear(x, w).dtype == torch.float32


# --- the GradScaler rules ----------------------------------------------------------------

@pytest.mark.parametrize("dtype, enabled, expected", [
    ("auto", True, torch.bfloat16),
    ("bf16", True, torch.bfloat16),
    ("fp32", True, torch.float32),
    ("fp16", False, torch.float32),
])
def test_no_scaler_unless_float16(dtype, enabled, expected):
    p = MixedPrecision("cpu", dtype, enabled=enabled)
    assert p.dtype == expected
    assert p.scaler is None
    assert p.enabled == (expected != torch.float32)


def test_float16_gets_a_working_scaler_built_for_the_device():
    p = MixedPrecision("cpu", "fp16")
    assert isinstance(p.scaler, torch.amp.GradScaler)
    assert p.scaler.is_enabled()  # a bare GradScaler() would be disabled here (see below)
    assert p.scaler.get_scale() == 2.0 ** 16


@no_cuda
def test_bare_gradscaler_silently_disables_itself_without_cuda():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bare = torch.amp.GradScaler()
    assert not bare.is_enabled()
    assert any("CUDA is not available" in str(w.message) for w in caught)
    assert torch.amp.GradScaler("cpu").is_enabled()


@pytest.mark.parametrize("make", [lambda: torch.cuda.amp.autocast(), lambda: torch.cuda.amp.GradScaler()],
                         ids=["autocast", "GradScaler"])
def test_torch_cuda_amp_is_deprecated(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "CUDA is not available" on this machine
        with pytest.warns(FutureWarning, match="torch.amp"):
            make()


def test_one_class_per_precision_chosen_once_with_the_same_calls():
    """MixedPrecision(...) builds the class that fits; each has the protocol TrainStep calls, with one
    update path: step(optimizer) only steps (clipping is TrainStep's, after unscale_)."""
    from course_utils.amp import Autocast, Float32, ScaledFloat16
    cases = [(("cpu",), {"enabled": False}, Float32), (("cpu", "fp32"), {}, Float32), (("cpu",), {}, Autocast),
             (("cpu", "bf16"), {}, Autocast), (("cpu", "fp16"), {}, ScaledFloat16)]
    for args, kwargs, cls in cases:
        p = MixedPrecision(*args, **kwargs)
        assert type(p) is cls and isinstance(p, MixedPrecision), (args, kwargs, type(p))
        assert (p.scaler is not None) == (cls is ScaledFloat16) and p.enabled == (cls is not Float32)
        for name, params in [("step", ["self", "optimizer"]), ("unscale_", ["self", "optimizer"]),
                             ("backward", ["self", "loss"]), ("autocast", ["self"])]:
            assert list(inspect.signature(getattr(type(p), name)).parameters) == params, (cls, name)
    assert type(copy.deepcopy(MixedPrecision("cpu", "fp16"))) is ScaledFloat16


# --- real steps on the CPU ---------------------------------------------------------------

def reference_fp16_step(model, opt, x, y, clip=None):
    """The textbook torch.amp recipe, written out: the oracle for MixedPrecision.step."""
    scaler = torch.amp.GradScaler("cpu")
    opt.zero_grad()
    with torch.amp.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = nn.utils.clip_grad_norm_(model.parameters(), clip) if clip else None
    scaler.step(opt)
    scaler.update()
    return loss, norm


@pytest.mark.parametrize("clip", [None, 0.05])
def test_fp16_step_matches_the_torch_recipe(clip):
    model, x_y = tiny_model(), tiny_batch()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    ref_loss, ref_norm = reference_fp16_step(ref, ref_opt, *x_y, clip=clip)

    p = MixedPrecision("cpu", "fp16")
    before = params_of(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation or "disabling" warning anywhere on the way
        step = TrainStep(model, opt, F.cross_entropy, p, grad_clip=clip)
        loss = step(*x_y)
    assert torch.equal(loss, ref_loss.detach())
    assert not loss.requires_grad and loss.dtype == torch.float32
    for a, b, old in zip(model.parameters(), ref.parameters(), before):
        torch.testing.assert_close(a, b)
        assert not torch.equal(a, old)
    if clip:
        torch.testing.assert_close(step.grad_norm, ref_norm)
    assert p.skipped_steps == 0 and p.scaler.get_scale() == 2.0 ** 16
    assert not torch.cuda.is_initialized()


def test_clipping_happens_on_unscaled_gradients():
    model, (x, y) = tiny_model(), tiny_batch()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    p = MixedPrecision("cpu", "fp16")
    before = params_of(model)
    opt.zero_grad()
    with p.autocast():
        loss = F.cross_entropy(model(x), y)
    p.backward(loss)
    p.unscale_(opt)  # the gradients in true units: clip them now
    norm = nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    applied = p.step(opt)  # does not unscale a second time
    assert applied
    assert norm > 1e-3  # the true gradient norm, so clipping had work to do
    moved = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(model.parameters(), before)))
    # lr=1: the update is the clipped gradient, norm 1e-3; clipping scaled grads would give 1e-3/65536
    torch.testing.assert_close(moved, torch.tensor(1e-3), rtol=1e-3, atol=0)


@pytest.mark.parametrize("fallback", [False, True], ids=["found_inf-flag", "get_scale-fallback"])
def test_overflow_skips_the_step_and_backs_off_the_scale(monkeypatch, fallback):
    if fallback:  # as if GradScaler's internals changed: the public get_scale() comparison must agree
        monkeypatch.setattr(amp, "_found_inf", lambda scaler, optimizer: None)
    model, (x, y) = tiny_model(), tiny_batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    p = MixedPrecision("cpu", "fp16", init_scale=2.0 ** 120)  # scaled grads overflow float16
    before = params_of(model)

    def one_step() -> bool:
        opt.zero_grad()
        with p.autocast():
            loss = F.cross_entropy(model(x), y)
        p.backward(loss)
        return p.step(opt)

    assert one_step() is False
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert p.scaler.get_scale() == 2.0 ** 119
    assert p.skipped_steps == 1
    p.scaler.update(2.0 ** 10)  # a sane scale: the next step goes through
    assert one_step() is True
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert p.skipped_steps == 1


def test_bf16_step_never_skips_and_clips():
    model, (x, y) = tiny_model(), tiny_batch()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = MixedPrecision("cpu", "bf16")
    step = TrainStep(model, opt, F.cross_entropy, p, grad_clip=0.01)
    step(x, y)
    with torch.amp.autocast("cpu", dtype=torch.bfloat16):
        F.cross_entropy(ref(x), y).backward()
    torch.testing.assert_close(step.grad_norm, nn.utils.clip_grad_norm_(ref.parameters(), 0.01))
    assert p.skipped_steps == 0


def test_step_misuse_gives_clear_errors():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="backward"):
        MixedPrecision("cpu", "fp16").step(opt)
    with pytest.raises(ValueError, match="grad_clip"):
        TrainStep(model, opt, F.cross_entropy, MixedPrecision("cpu", "bf16"), grad_clip=0)


def test_bf16_training_tracks_fp32():
    data = synthetic_digits(512, seed=0)
    curves = {}
    for dtype in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = SimpleCNN()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        p = MixedPrecision("cpu", dtype)
        losses = []
        for i in range(24):
            j = (i % 8) * 64
            losses.append(train_step(model, opt, F.cross_entropy, data.images[j:j + 64],
                                     data.labels[j:j + 64], p))
        curves[dtype] = torch.stack(losses)
    fp32, bf16 = curves["fp32"], curves["bf16"]
    assert fp32[-4:].mean() < fp32[:4].mean() - 0.1  # it learned something, so tracking means something
    assert not torch.equal(bf16, fp32)  # autocast really ran in bf16
    torch.testing.assert_close(bf16, fp32, rtol=0.03, atol=0.0)  # measured drift here: under 0.3%


# --- checkpoints -------------------------------------------------------------------------

def test_scaler_state_round_trips_through_a_checkpoint():
    model, (x, y) = tiny_model(), tiny_batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = MixedPrecision("cpu", "fp16", init_scale=2.0 ** 120, growth_interval=3)
    for _ in range(3):  # one overflow (scale halves), then good steps (growth tracker counts)
        train_step(model, opt, F.cross_entropy, x, y, p)
        if p.scaler.get_scale() > 2.0 ** 12:
            p.scaler.update(2.0 ** 12)
    saved = p.state_dict()
    assert saved["dtype"] == "float16" and saved["scaler"]["_growth_tracker"] == 2

    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    restored = MixedPrecision("cpu", "fp16")
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert restored.state_dict() == saved
    # and it behaves like the original: one more good step reaches growth_interval and doubles the scale
    for q in (p, restored):
        m = copy.deepcopy(model)
        train_step(m, torch.optim.SGD(m.parameters(), lr=0.1), F.cross_entropy, x, y, q)
    assert restored.scaler.get_scale() == p.scaler.get_scale() == 2.0 ** 13


def test_state_dict_across_precisions_and_bad_input():
    fresh = MixedPrecision("cpu", "fp16")
    fresh.load_state_dict(MixedPrecision("cpu", "bf16").state_dict())  # no scaler state: stays fresh
    assert fresh.scaler.get_scale() == 2.0 ** 16
    bf16 = MixedPrecision("cpu", "bf16")
    bf16.load_state_dict(MixedPrecision("cpu", "fp16", init_scale=8.0).state_dict())  # dropped
    assert bf16.scaler is None
    with pytest.raises(ValueError, match="MixedPrecision state"):
        fresh.load_state_dict({"scale": 1.0})


# --- measurements ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_table_is_measured_on_this_device(dtype):
    table = autocast_dtype_table("cpu", dtype)
    assert all(isinstance(row, OpDtypes) for row in table.values())
    for op in ("matmul", "linear", "conv2d"):  # autocast's lower-precision list
        assert table[op] == OpDtypes(dtype, dtype)
    for op in ("cross_entropy", "mse_loss"):  # losses stay float32, even from low-precision inputs
        assert table[op] == OpDtypes(torch.float32, torch.float32)
    assert table["relu"] == OpDtypes(torch.float32, dtype)  # not on any list: follows its input
    with pytest.raises(ValueError, match="low-precision"):
        autocast_dtype_table("cpu", "fp32")


def test_underflow_fraction_follows_float16_rounding():
    smallest = torch.finfo(torch.float16).tiny * 2.0 ** -10  # smallest float16 subnormal, 2**-24
    # below half the smallest subnormal rounds to zero; above it, to the smallest subnormal
    g = torch.tensor([0.25, 0.4, -0.3, 0.6, 3.0]) * smallest
    big = torch.tensor([1.0, 0.0, 0.0])
    assert underflow_fraction(g) == pytest.approx(3 / 5)
    assert underflow_fraction([g, None, big]) == pytest.approx(3 / 6)  # zeros and None don't count
    assert underflow_fraction(g, torch.bfloat16) == 0.0  # bf16 has float32's exponent range
    assert underflow_fraction(g, scale=2.0 ** 10) == 0.0  # loss scaling rescues them
    assert underflow_fraction(torch.zeros(3)) == 0.0


def test_underflow_fraction_on_real_gradients_against_a_direct_count():
    model, (x, y) = tiny_model(), tiny_batch()
    (F.cross_entropy(model(x), y) * 1e-6).backward()  # tiny loss, tiny gradients
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    direct = ((flat != 0) & (flat.half() == 0)).sum().item() / (flat != 0).sum().item()
    assert 0.0 < direct < 1.0
    assert underflow_fraction(grads) == pytest.approx(direct)


def test_underflow_fraction_bad_input():
    with pytest.raises(ValueError, match="backward"):
        underflow_fraction([None, None])
    with pytest.raises(TypeError, match="floating-point"):
        underflow_fraction(torch.arange(3))
    with pytest.raises(ValueError, match="scale"):
        underflow_fraction(torch.ones(3), scale=0)


def test_import_has_no_side_effects():
    code = ("import threading, torch, course_utils.amp; "
            "assert not torch.cuda.is_initialized(); assert threading.active_count() == 1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
