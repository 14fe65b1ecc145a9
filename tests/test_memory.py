"""course_utils.memory: the simulated GPU's accounting, OOM recognition and recovery, the memory
estimator, the batch-size search, the OOM-resilient step and activation checkpointing.

PyTorch is the oracle: expected byte counts come from storages' own sizes, expected updates from a
plain training step on a copy of the model.
"""
import copy
import warnings
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_utils.memory import (
    CUDA_BLOCK_BYTES, OOM_MESSAGES, BatchSizeSearch, MemoryEstimate, ResilientStep,
    ResilientStepOutOfMemoryError, SimulatedGPU, SimulatedOutOfMemoryError, checkpoint_sequential_blocks,
    checkpointed, estimate_training_memory, find_max_batch_size, format_bytes, free_memory, is_oom_error,
    limit_gpu_memory, parse_bytes, profiled_peak, resident_bytes,
)
from course_utils.amp import MixedPrecision
from course_utils.models import CifarCNN, SimpleCNN
from course_utils.step import TrainStep

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
}


def counted(t: torch.Tensor) -> int:
    """What a CUDA-like allocator charges for t's storage: its size rounded up to 512 bytes."""
    n = t.untyped_storage().nbytes()
    return -(-n // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


def mlp(seed: int = 0, width: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 5))


def batch(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 20, generator=g), torch.randint(0, 5, (n,), generator=g)


def plain_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def clone_pair(model, opt):
    """Copies of a model and its optimizer, the copy's optimizer pointing at the copy's parameters."""
    return copy.deepcopy((model, opt))


def step_peak(model, opt, x, y, steps: int = 2) -> int:
    """Peak simulated memory of `steps` plain steps (batch made inside, as if moved to the GPU)."""
    with SimulatedGPU("64GiB", model=model, optimizer=opt) as gpu:
        xb, yb = x.clone(), y.clone()
        for _ in range(steps):
            plain_step(model, opt, xb, yb)
        return gpu.max_memory_allocated()


# --- sizes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("64MiB", 64 * 2**20), ("1.5 GiB", int(1.5 * 2**30)), ("500MB", 500 * 10**6), ("512", 512),
    ("2k", 2048), (" 3 KiB ", 3072), (4096, 4096), (1e9, 10**9),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "lots", "12 parsecs", "-1MiB", 0, -5, 1.5, True, None, [1]])
def test_parse_bytes_rejects_bad_input_clearly(bad):
    with pytest.raises(ValueError, match="memory size|whole number"):
        parse_bytes(bad)


def test_format_bytes_uses_cuda_style_units():
    assert format_bytes(100) == "100 bytes"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(20 * 2**20) == "20.00 MiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"


# --- SimulatedGPU accounting ------------------------------------------------------------------------

def test_new_tensors_are_counted_rounded_and_released_when_freed():
    with SimulatedGPU("1MiB") as gpu:
        a = torch.empty(1000)  # 4000 bytes -> 4096
        assert gpu.memory_allocated() == counted(a) == 4096
        b = torch.ones(3, dtype=torch.float64)  # 24 bytes -> one 512-byte block
        assert gpu.memory_allocated() == counted(a) + counted(b) == 4096 + 512
        del a
        assert gpu.memory_allocated() == counted(b)
        del b
        assert gpu.memory_allocated() == 0
    assert gpu.max_memory_allocated() == 4096 + 512


def test_block_size_is_configurable():
    with SimulatedGPU("1MiB", block_bytes=1) as gpu:
        a = torch.empty(3, dtype=torch.int16)
        assert gpu.memory_allocated() == a.untyped_storage().nbytes() == 6


def test_views_add_nothing():
    with SimulatedGPU("1MiB") as gpu:
        a = torch.randn(64, 64)
        before = gpu.memory_allocated()
        views = [a.view(-1), a[::2], a.t(), a.detach(), a.reshape(4096), *a.split(16), a.unsqueeze(0),
                 a.expand(2, 64, 64)]
        assert gpu.memory_allocated() == before == counted(a)
        assert all(v.untyped_storage()._cdata == a.untyped_storage()._cdata for v in views)
        del a
        assert gpu.memory_allocated() == before  # the views keep the storage alive
        del views
        assert gpu.memory_allocated() == 0


def test_copies_are_new_storage():
    with SimulatedGPU("1MiB") as gpu:
        a = torch.randn(64, 64)
        b = a.t().contiguous()  # a real copy
        assert gpu.memory_allocated() == counted(a) + counted(b)


def test_in_place_ops_add_nothing():
    with SimulatedGPU("1MiB") as gpu:
        a = torch.randn(1000)
        b = torch.randn(1000)
        before = gpu.memory_allocated()
        a.add_(1).mul_(b).clamp_(min=0)
        a[10:20] = 3.0
        torch._foreach_add_([a, b], 1.0)
        assert gpu.memory_allocated() == before


def test_out_argument_counts_only_what_it_allocates():
    with SimulatedGPU("1MiB") as gpu:
        a = torch.randn(1000)
        ready = torch.empty(1000)
        before = gpu.memory_allocated()
        torch.add(a, 1, out=ready)  # right size already: no allocation
        assert gpu.memory_allocated() == before
        empty = torch.empty(0)
        assert gpu.memory_allocated() == before  # zero bytes
        torch.mul(a, 2, out=empty)  # out= has to grow `empty` to 4000 bytes
        assert empty.shape == (1000,)
        assert gpu.memory_allocated() == before + counted(empty) == before + 4096


def test_resize_grows_the_count_and_never_shrinks_it():
    with SimulatedGPU("1MiB") as gpu:
        a = torch.empty(100)
        assert gpu.memory_allocated() == 512
        a.resize_(5000)
        assert gpu.memory_allocated() == counted(a) == 20480
        a.resize_(10)  # PyTorch keeps the storage: shrinking frees nothing
        assert a.untyped_storage().nbytes() == 20000
        assert gpu.memory_allocated() == 20480


def test_resize_beyond_the_budget_fails_before_allocating():
    with SimulatedGPU("64KiB") as gpu:
        a = torch.empty(100)
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
            a.resize_(1_000_000)
        assert a.shape == (100,) and a.untyped_storage().nbytes() == 400
        assert gpu.memory_allocated() == 512


def test_tensors_made_outside_are_not_counted_unless_tracked():
    outside = torch.zeros(1000)
    with SimulatedGPU("1MiB") as gpu:
        outside.add_(1)
        v = outside.view(10, 100)
        y = v * 2  # a new tensor made inside
        assert gpu.memory_allocated() == counted(y)
        assert gpu.track(outside) is outside
        assert gpu.memory_allocated() == counted(y) + counted(outside)
        gpu.track(outside)  # counted once
        assert gpu.memory_allocated() == counted(y) + counted(outside)


def test_an_outside_tensor_that_has_to_grow_inside_is_counted():
    outside = torch.zeros(10)
    with SimulatedGPU("1MiB") as gpu:
        outside.resize_(1000)
        assert gpu.memory_allocated() == counted(outside) == 4096


def test_tensors_from_data_are_counted():
    with SimulatedGPU("1MiB") as gpu:
        t = torch.tensor([1.0] * 300)
        assert gpu.memory_allocated() == counted(t) == 1536


def test_model_and_optimizer_are_counted_on_entry_and_classified():
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    param_bytes = sum(counted(p) for p in model.parameters())
    with SimulatedGPU("16MiB", model=model, optimizer=opt) as gpu:
        assert gpu.memory_allocated() == param_bytes
        x, y = batch(32)
        x, y = x.clone(), y.clone()
        plain_step(model, opt, x, y)
        b = gpu.breakdown()
        state_bytes = sum(counted(t) for s in opt.state.values() for t in s.values())
        assert b.parameters == param_bytes
        assert b.gradients == sum(counted(p.grad) for p in model.parameters())
        assert b.optimizer_state == state_bytes
        assert state_bytes >= 2 * param_bytes  # exp_avg and exp_avg_sq (+ step counters)
        assert b.activations == counted(x) + counted(y)  # the loss of plain_step was dropped
        assert b.total == gpu.memory_allocated()
        assert "optimizer state" in str(b)


def test_autograd_saved_tensors_are_counted_until_the_graph_goes():
    w = torch.randn(32, 16, requires_grad=True)
    with SimulatedGPU("1MiB") as gpu:
        x = torch.randn(8, 32)
        loss = torch.relu(x @ w).sum()  # mm saves x (and w); relu saves its output; mm's output is freed
        saved_relu_out = loss.grad_fn.next_functions[0][0]._saved_result
        relu_bytes = counted(saved_relu_out)
        assert gpu.memory_allocated() == counted(x) + relu_bytes + counted(loss)
        del saved_relu_out
        before_backward = gpu.memory_allocated()
        loss.backward()
        # the graph's saved relu output is gone; w.grad is new (the grad of x is not needed)
        assert gpu.memory_allocated() == before_backward - relu_bytes + counted(w.grad)
        del loss
        assert gpu.memory_allocated() == counted(x) + counted(w.grad)


def test_gradient_accumulation_keeps_one_gradient_per_parameter():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(16)
    with SimulatedGPU("16MiB", model=model, optimizer=opt) as gpu:
        for _ in range(3):  # no zero_grad: .grad accumulates
            F.cross_entropy(model(x), y).backward()
        grads = sum(counted(p.grad) for p in model.parameters())
        assert gpu.breakdown().gradients == grads
        assert gpu.memory_allocated() == sum(counted(p) for p in model.parameters()) + grads
        opt.zero_grad(set_to_none=True)
        assert gpu.memory_allocated() == sum(counted(p) for p in model.parameters())


@pytest.mark.parametrize("opt_name", ["sgd", "momentum", "adam"])
def test_peak_of_a_training_step_agrees_with_pytorchs_mem_tracker(opt_name):
    """PyTorch's own memory tracker (torch.distributed._tools.mem_tracker) as an independent oracle."""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    torch.manual_seed(0)
    model = SimpleCNN()
    opt = OPTIMIZERS[opt_name](model.parameters())
    x, y = torch.rand(32, 1, 28, 28), torch.randint(0, 10, (32,))
    plain_step(model, opt, x, y)  # optimizer state exists: the steady-state step
    tracker = mem_tracker.MemTracker()
    tracker.track_external(model, opt, x, y)
    with tracker:
        plain_step(model, opt, x, y)
    expected = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    with SimulatedGPU("1GiB", model=model, optimizer=opt, block_bytes=1) as gpu:
        gpu.track(x, y)
        plain_step(model, opt, x, y)
    assert gpu.max_memory_allocated() == expected


def test_peak_and_reset_peak():
    with SimulatedGPU("1MiB") as gpu:
        a = torch.empty(10_000)
        del a
        assert gpu.memory_allocated() == 0
        assert gpu.max_memory_allocated() == 40448
        gpu.reset_peak_memory_stats()
        assert gpu.max_memory_allocated() == 0
        b = torch.empty(100)
        assert gpu.max_memory_allocated() == counted(b)


def test_paused_allocations_are_not_counted_but_frees_are():
    with SimulatedGPU("1MiB") as gpu:
        a = torch.empty(1000)
        with gpu.paused():
            backup = a.clone()
            del a
        assert backup.shape == (1000,)
        assert gpu.memory_allocated() == 0


def test_simulated_gpu_rejects_bad_arguments():
    with pytest.raises(ValueError, match="memory size"):
        SimulatedGPU("lots")
    with pytest.raises(TypeError, match="nn.Module"):
        SimulatedGPU("1MiB", model="resnet")
    with pytest.raises(TypeError, match="Optimizer"):
        SimulatedGPU("1MiB", optimizer=[])
    gpu = SimulatedGPU("1MiB")
    with gpu:
        with pytest.raises(RuntimeError, match="already active"):
            gpu.__enter__()
        with pytest.raises(TypeError, match="track"):
            gpu.track("a string")


# --- simulated OOM --------------------------------------------------------------------------------

def test_simulated_oom_is_a_torch_out_of_memory_error_with_a_cuda_like_message():
    with SimulatedGPU("1MiB") as gpu:
        keep = torch.empty(100_000)  # 400000 bytes -> 391 KiB
        try:
            torch.empty(300_000)
        except torch.cuda.OutOfMemoryError as exc:  # the same class as torch.OutOfMemoryError
            err = exc
        else:
            pytest.fail("no simulated OOM")
        assert isinstance(err, torch.OutOfMemoryError) and isinstance(err, SimulatedOutOfMemoryError)
        msg = str(err)
        assert msg.startswith("CUDA out of memory. Tried to allocate")  # as code written for CUDA expects
        assert "Simulated by course_utils.memory.SimulatedGPU" in msg
        assert f"Tried to allocate {format_bytes(1_200_128)}" in msg
        assert f"Of the allocated memory {format_bytes(counted(keep))} is allocated by PyTorch" in msg
        assert "GPU 0 has a total capacity of 1.00 MiB of which" in msg
        assert err.requested == 1_200_128 and err.allocated == counted(keep) and err.budget == 2**20
        assert is_oom_error(err)
        del err
        assert gpu.memory_allocated() == counted(keep)
        assert gpu.oom_count == 1


def test_model_that_does_not_fit_fails_on_entry():
    model = mlp(width=512)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        with SimulatedGPU("64KiB", model=model):
            pass


def forward_peak(model, x, y) -> tuple[int, int]:
    with SimulatedGPU("64GiB", model=model) as gpu:
        base = gpu.memory_allocated()
        loss = F.cross_entropy(model(x), y)
        peak = gpu.max_memory_allocated()
        del loss
    return base, peak


def test_no_leak_after_oom_and_the_traceback_holds_the_failed_step_until_except_ends():
    model = SimpleCNN()
    x, y = torch.rand(64, 1, 28, 28), torch.randint(0, 10, (64,))
    base, peak = forward_peak(model, x, y)
    with SimulatedGPU((base + peak) // 2, model=model) as gpu:
        assert gpu.memory_allocated() == base
        inside = None
        try:
            F.cross_entropy(model(x), y)
        except torch.OutOfMemoryError:
            inside = gpu.memory_allocated()  # the traceback's frames still hold earlier activations
        assert inside is not None and inside > base
        assert gpu.memory_allocated() == base  # the except block ended: everything went
        # recovery outside the except block can now use the memory: half the batch fits
        loss = F.cross_entropy(model(x[:16]), y[:16])
        assert gpu.memory_allocated() > base
        del loss
        assert gpu.memory_allocated() == base


def test_oom_in_backward_crosses_the_autograd_engine_unchanged():
    model = SimpleCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.rand(64, 1, 28, 28), torch.randint(0, 10, (64,))
    base, fwd_peak = forward_peak(model, x, y)
    with SimulatedGPU(fwd_peak + 4096, model=model, optimizer=opt) as gpu:
        loss = F.cross_entropy(model(x), y)
        with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
            loss.backward()
        del loss
        opt.zero_grad(set_to_none=True)  # gradients finished before the failure
        assert gpu.memory_allocated() == base


# --- recognising OOM ----------------------------------------------------------------------------

@pytest.mark.parametrize("message", [
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 15.77 GiB",
    "HIP out of memory. Tried to allocate 2.00 MiB (GPU 0; 512.00 MiB total capacity)",
    "XPU out of memory. Tried to allocate 16.00 MiB. GPU 0 has a total capacity of 11.93 GiB",
    "MPS backend out of memory (MPS allocated: 17.68 GB, other allocations: 3.95 MB, max allowed: 18.13 GB).",
    "[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
    "allocate 2359296 bytes. Error code 12 (Cannot allocate memory)",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
    "CUDA error: out of memory",
])
def test_is_oom_error_recognises_backend_messages(message):
    assert is_oom_error(RuntimeError(message))


@pytest.mark.parametrize("exc", [
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (64x10 and 20x5)"),
    ValueError("out of range"), KeyboardInterrupt(),
])
def test_is_oom_error_rejects_other_errors(exc):
    assert not is_oom_error(exc)


def test_is_oom_error_by_type_first():
    assert is_oom_error(torch.OutOfMemoryError("no message at all"))
    assert is_oom_error(MemoryError())
    assert all(m for m in OOM_MESSAGES)


def test_is_oom_error_follows_cause_and_context_and_survives_cycles():
    oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    try:
        try:
            raise oom
        except RuntimeError:
            raise ValueError("wrapper while handling")  # __context__
    except ValueError as exc:
        wrapped_context = exc
    wrapped_cause = RuntimeError("backend compiler failed")
    wrapped_cause.__cause__ = oom
    assert is_oom_error(wrapped_context) and is_oom_error(wrapped_cause)

    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a  # a cycle without OOM terminates
    assert not is_oom_error(a)
    a.__cause__ = oom
    assert is_oom_error(b)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="ExceptionGroup is Python 3.11+")
def test_is_oom_error_looks_inside_exception_groups():
    group = ExceptionGroup("workers failed", [ValueError("x"), RuntimeError("HIP out of memory")])  # noqa: F821
    assert is_oom_error(group)


def test_is_oom_error_bad_input():
    assert is_oom_error(None) is False
    with pytest.raises(TypeError, match="expects an exception"):
        is_oom_error("CUDA out of memory")


def test_free_memory_collects_cycles_that_hold_tensors_and_does_not_start_cuda():
    class Node:
        pass

    with SimulatedGPU("1MiB") as gpu:
        a, b = Node(), Node()
        a.other, b.other = b, a  # a reference cycle: only the garbage collector frees it
        a.tensor = torch.empty(10_000)
        del a, b
        assert gpu.memory_allocated() == 40448
        report = free_memory()
        assert gpu.memory_allocated() == 0
        assert report.collected >= 2
    if not torch.cuda.is_available():
        assert "cuda" not in report.emptied
        assert not torch.cuda.is_initialized()


# --- limit_gpu_memory -------------------------------------------------------------------------------

@no_cuda
def test_limit_gpu_memory_on_cpu_says_to_use_simulated_gpu():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU.*SimulatedGPU"):
        with limit_gpu_memory("1GiB"):
            pass
    assert not torch.cuda.is_initialized()


def test_limit_gpu_memory_rejects_bad_budgets():
    with pytest.raises(ValueError, match="memory size"):
        limit_gpu_memory("-3GiB")


@needs_cuda
def test_limit_gpu_memory_caps_and_restores_on_cuda():
    before = torch.cuda.get_per_process_memory_fraction(0)
    with limit_gpu_memory("256MiB", 0):
        torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # fits
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    assert torch.cuda.get_per_process_memory_fraction(0) == before
    big = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")  # fine again
    del big
    with pytest.raises(ValueError, match="more than"):
        with limit_gpu_memory(torch.cuda.get_device_properties(0).total_memory + 1):
            pass


# --- estimate_training_memory -------------------------------------------------------------------------

# Each model with each optimizer, batch sizes 32..512 spread over them (benchmarks/bench_memory.py runs the
# full grid).
@pytest.mark.parametrize("model_cls, shape, batch_size, opt_name", [
    (SimpleCNN, (1, 28, 28), 32, "sgd"), (SimpleCNN, (1, 28, 28), 512, "momentum"),
    (SimpleCNN, (1, 28, 28), 128, "adam"), (CifarCNN, (3, 32, 32), 128, "sgd"),
    (CifarCNN, (3, 32, 32), 32, "momentum"), (CifarCNN, (3, 32, 32), 256, "adam"),
])
def test_estimate_is_within_10_percent_of_the_simulated_peak(model_cls, shape, batch_size, opt_name):
    torch.manual_seed(0)
    model = model_cls()
    opt = OPTIMIZERS[opt_name](model.parameters())
    x, y = torch.rand(batch_size, *shape), torch.randint(0, 10, (batch_size,))
    est = estimate_training_memory(model, opt, (x, y), nn.CrossEntropyLoss())
    assert not opt.state  # the estimator did not touch the real optimizer
    measured = step_peak(model, opt, x, y)  # steady state: the second step runs with optimizer state
    assert abs(est.total - measured) <= 0.10 * measured, (est, format_bytes(measured))

    # the parts, against PyTorch's own numbers
    assert est.parameters == sum(counted(p) for p in model.parameters())
    assert est.gradients == est.parameters
    assert est.batch == counted(x) + counted(y)
    state_tensors = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert est.optimizer_state == sum(counted(t) for t in state_tensors)
    expected_multiple = {"sgd": 0, "momentum": 1, "adam": 2}[opt_name]
    big_state = sum(counted(t) for t in state_tensors if t.dim() > 0)
    assert big_state == expected_multiple * est.parameters
    assert est.activations > 0


def test_profiled_peak_counts_what_the_allocator_hands_out(monkeypatch):
    """The independent oracle itself, on allocations whose sizes are known: resident storages counted once each,
    then the largest running total of what the function allocated and freed."""
    monkeypatch.setenv("KINETO_LOG_LEVEL", "6")
    kept = torch.empty(1000, dtype=torch.float64)  # 8000 bytes, alive before and after
    view = kept[10:20]  # the same storage: not counted twice

    def fn():
        a = torch.empty(1 << 20, dtype=torch.uint8)   # 1 MiB
        b = torch.empty(3 << 19, dtype=torch.uint8)   # 1.5 MiB: 2.5 MiB alive
        del a
        c = torch.empty(1 << 19, dtype=torch.uint8)   # 0.5 MiB: 2 MiB alive, below the peak
        return b, c

    assert resident_bytes(kept, view, [kept], {"k": kept}) == 8000
    assert profiled_peak(fn, kept, view) == 8000 + (5 << 19)


def test_profiled_peak_refuses_what_it_cannot_see_and_counts_sparse_gradients(monkeypatch):
    """A resident storage freed inside fn (gradients set to None at the step's start) is a free the profiler cannot
    record: refused with the advice, instead of a peak counted twice. Sparse gradients are counted."""
    monkeypatch.setenv("KINETO_LOG_LEVEL", "6")
    model = nn.Linear(256, 256, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(1, 256)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()

    step()  # model.weight.grad exists now
    with pytest.raises(ValueError, match="zero_grad"):
        profiled_peak(step, model, opt, x)
    opt.zero_grad(set_to_none=True)
    before = resident_bytes(model, opt, x)
    assert profiled_peak(step, model, opt, x) >= before + 256 * 256 * 4  # the new gradient at least
    emb = nn.Embedding(100, 8, sparse=True)
    emb(torch.tensor([1, 2, 2])).sum().backward()
    grad = emb.weight.grad
    assert resident_bytes(emb) == 100 * 8 * 4 + grad._indices().nbytes + grad._values().nbytes


def _mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 10))


def _bn_cnn():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(16 * 16 * 16, 10))


@pytest.mark.parametrize("make_model, shape", [(_mlp, (1, 28, 28)), (SimpleCNN, (1, 28, 28)),
                                               (CifarCNN, (3, 32, 32)), (_bn_cnn, (3, 32, 32))])
@pytest.mark.parametrize("opt_name", ["sgd", "momentum", "adam", "adamw"])
@pytest.mark.parametrize("batch_size", [1, 48, 200])
def test_estimate_is_within_10_percent_of_pytorchs_own_allocator_count(monkeypatch, make_model, shape, opt_name,
                                                                        batch_size):
    """The estimator against an oracle that shares no code with it (SimulatedGPU shares its ledger): the CPU
    allocator's own events, recorded by torch.profiler during a steady-state training step."""
    monkeypatch.setenv("KINETO_LOG_LEVEL", "6")
    torch.manual_seed(0)
    model = make_model()
    make = {**OPTIMIZERS, "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3)}[opt_name]
    opt = make(model.parameters())
    x, y = torch.rand(batch_size, *shape), torch.randint(0, 10, (batch_size,))

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    step()  # the optimizer state exists from now on, as in every later step
    opt.zero_grad(set_to_none=True)
    measured = profiled_peak(step, model, opt, x, y)
    est = estimate_training_memory(model, opt, (x, y), F.cross_entropy)
    assert abs(est.total - measured) <= 0.10 * measured, (est, format_bytes(measured))


def test_estimate_grows_with_batch_size_and_is_readable():
    model = SimpleCNN()
    opt = torch.optim.Adam(model.parameters())
    def estimate(n):
        return estimate_training_memory(model, opt, (torch.rand(n, 1, 28, 28), torch.randint(0, 10, (n,))),
                                        F.cross_entropy)

    small, big = estimate(32), estimate(256)
    assert isinstance(big, MemoryEstimate)
    assert big.activations > 4 * small.activations  # activations scale with the batch
    assert big.parameters == small.parameters and big.optimizer_state == small.optimizer_state
    text = str(big)
    for label in ("parameters", "gradients", "optimizer state", "activations", "predicted peak", "Adam"):
        assert label in text


def test_estimate_allocates_no_real_memory_and_leaves_the_model_alone():
    model = SimpleCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = copy.deepcopy(model.state_dict())
    x, y = torch.rand(512, 1, 28, 28), torch.randint(0, 10, (512,))
    with SimulatedGPU("64GiB", model=model, optimizer=opt) as gpu:
        base = gpu.memory_allocated()
        est = estimate_training_memory(model, opt, (x, y), F.cross_entropy)
        assert gpu.max_memory_allocated() == base  # no real storage was created on the way
    assert est.activations > 50 * 2**20  # while the predicted activations are large
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not opt.state


def test_estimate_for_other_optimizers_measures_their_state_on_fake_tensors():
    model = mlp()
    opt = torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.9)  # square_avg + momentum_buffer
    x, y = batch(64)
    est = estimate_training_memory(model, opt, (x, y), F.cross_entropy)
    assert "measured" in est.state_source
    step_peak(model, opt, x, y, steps=1)
    real_state = sum(counted(t) for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    assert est.optimizer_state == real_state


def test_estimate_with_inputs_only_and_autocast():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(256, 20)
    fp32 = estimate_training_memory(model, opt, x)  # loss defaults to outputs.sum()
    bf16 = estimate_training_memory(model, opt, x, autocast_dtype=torch.bfloat16)
    assert fp32.batch == counted(x)
    assert bf16.activations < fp32.activations


def test_estimate_rejects_bad_input():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="example_batch"):
        estimate_training_memory(model, opt, [1, 2, 3])
    with pytest.raises(TypeError, match="nn.Module"):
        estimate_training_memory("model", opt, torch.randn(2, 20))
    with pytest.raises(RuntimeError, match="fake tensors"):
        estimate_training_memory(model, opt, torch.randn(2, 7))  # wrong feature count


# --- find_max_batch_size ------------------------------------------------------------------------------

def snapshot(model, opt):
    return (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
            [None if p.grad is None else p.grad.clone() for p in model.parameters()], torch.get_rng_state())


def assert_same(a, b):
    (ma, oa, ga, ra), (mb, ob, gb, rb) = a, b
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for k in oa["state"]:
        sa, sb = oa["state"][k], ob["state"][k]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[j], sb[j]) for j in sa)
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(ga, gb))
    assert torch.equal(ra, rb)


def test_find_max_batch_size_finds_the_boundary_and_restores_everything():
    model = mlp(width=128)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    plain_step(model, opt, *batch(8))  # some optimizer state and gradients to preserve
    before = snapshot(model, opt)
    budget = step_peak(*clone_pair(model, opt), *batch(300))  # about 300 fit

    def make(n):
        return batch(n, seed=n)

    result = find_max_batch_size(make, model, opt, F.cross_entropy, budget=budget, start=16, max_size=4096)
    assert_same(before, snapshot(model, opt))
    assert isinstance(result, BatchSizeSearch)
    best = result.largest_ok
    assert result.batch_size == best and result.smallest_failed == best + 1
    # PyTorch oracle: best fits, best + 1 does not
    with SimulatedGPU(budget, model=model, optimizer=opt):
        for _ in range(2):
            plain_step(model, opt, *make(best))
        with pytest.raises(torch.OutOfMemoryError):
            for _ in range(2):
                plain_step(model, opt, *make(best + 1))
    sizes = [t.size for t in result.trials]
    assert sizes[:5] == [16, 32, 64, 128, 256] and 512 in sizes  # doubling, then binary search
    assert all(t.ok == (t.size <= best) for t in result.trials)
    assert all(t.peak_bytes is not None and t.peak_bytes <= budget for t in result.trials)
    # a failed trial's peak is below the budget; the allocation that did not fit takes it over
    assert all(t.peak_bytes + t.refused_bytes > budget for t in result.trials if not t.ok)
    assert all(t.refused_bytes is None for t in result.trials if t.ok)
    oks = [t for t in result.trials if t.ok]
    assert [t.peak_bytes for t in sorted(oks)] == sorted(t.peak_bytes for t in oks)  # grows with size
    assert "fits" in str(result) and "OOM" in str(result)


def test_find_max_batch_size_with_a_dataset_safety_margin_and_a_caller_context():
    from course_utils.data import synthetic_digits

    data = synthetic_digits(10, seed=0)  # fewer samples than the batches tried: they are reused
    model = SimpleCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    budget = step_peak(*clone_pair(model, opt), data.images[[i % 10 for i in range(12)]], data.labels[:2].repeat(6))
    with SimulatedGPU(budget, model=model, optimizer=opt) as gpu:
        F.cross_entropy(model(data.images[:2]), data.labels[:2]).backward()  # gradients to restore
        base = gpu.memory_allocated()
        assert base > sum(counted(p) for p in model.parameters())
        result = find_max_batch_size(data, model, opt, F.cross_entropy, start=8, max_size=256, safety_margin=0.25,
                                     steps_per_trial=1)
        assert gpu.memory_allocated() == base  # the restored gradients are counted again
        assert gpu.breakdown().gradients == sum(counted(p.grad) for p in model.parameters())
    assert 8 <= result.largest_ok < 16
    assert result.batch_size == int(result.largest_ok * 0.75)


def test_find_max_batch_size_when_max_size_fits():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = find_max_batch_size(batch, model, opt, F.cross_entropy, start=3, max_size=20, budget="1GiB")
    assert [t.size for t in result.trials] == [3, 6, 12, 20]
    assert result.largest_ok == 20 and result.smallest_failed is None
    dataset = torch.utils.data.TensorDataset(*batch(5))  # any indexable dataset of (x, y) pairs
    result = find_max_batch_size(dataset, model, opt, F.cross_entropy, start=4, max_size=8, budget="1GiB")
    assert [t.size for t in result.trials] == [4, 8] and result.batch_size == 8


def test_find_max_batch_size_propagates_other_errors_and_still_restores():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain_step(model, opt, *batch(8))
    before = snapshot(model, opt)

    def broken(n):
        x, y = batch(n)
        return x[:, :7], y  # wrong feature count: a shape error, not OOM

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        find_max_batch_size(broken, model, opt, F.cross_entropy, budget="1GiB")
    assert_same(before, snapshot(model, opt))


def test_find_max_batch_size_when_nothing_fits_and_bad_arguments():
    model = mlp(width=512)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = sum(counted(p) for p in model.parameters())
    with pytest.raises(RuntimeError, match="even a batch of 1"):
        find_max_batch_size(batch, model, opt, F.cross_entropy, budget=params + 1024, start=4)
    for kwargs, match in [({"start": 0}, "start"), ({"max_size": 0}, "max_size"), ({"safety_margin": 1.0}, "safety"),
                          ({"steps_per_trial": 0}, "steps_per_trial")]:
        with pytest.raises(ValueError, match=match):
            find_max_batch_size(batch, model, opt, F.cross_entropy, **kwargs)
    with pytest.raises(TypeError, match="callable"):
        find_max_batch_size(42, model, opt, F.cross_entropy)


# --- ResilientStep ------------------------------------------------------------------------------------

def budget_between_half_and_full(model, opt, x, y) -> int:
    n = len(x)
    full = step_peak(*clone_pair(model, opt), x, y)
    half = step_peak(*clone_pair(model, opt), x[: n // 2], y[: n // 2])
    assert half < full
    return (half + full) // 2


@pytest.mark.parametrize("opt_name", ["momentum", "adam"])
def test_resilient_step_update_equals_the_full_batch_update(opt_name):
    model = mlp(width=256)
    opt = OPTIMIZERS[opt_name](model.parameters())
    plain_step(model, opt, *batch(64, seed=5))  # existing optimizer state
    opt.zero_grad(set_to_none=True)
    x, y = batch(256)
    budget = budget_between_half_and_full(model, opt, x, y)

    oracle, oracle_opt = clone_pair(model, opt)
    expected_loss = plain_step(oracle, oracle_opt, x, y)

    step = ResilientStep(model, opt, F.cross_entropy)
    with SimulatedGPU(budget, model=model, optimizer=opt) as gpu:
        base = gpu.memory_allocated()
        xb, yb = x.clone(), y.clone()
        loss = step(xb, yb)
        # halved until it fit (gradient accumulation needs more than a plain step of the same size)
        assert step.oom_count >= 1 and step.micro_batch_size == 256 >> step.oom_count
        assert loss.dim() == 0 and not loss.requires_grad and loss.device == x.device
        with gpu.paused():  # comparing allocates too; keep it off the budget
            torch.testing.assert_close(loss, expected_loss)
            for p, q in zip(model.parameters(), oracle.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        # later calls start at the remembered size: no new OOM
        ooms = step.oom_count
        step(xb, yb)
        assert step.oom_count == ooms
        del loss, xb, yb
        opt.zero_grad(set_to_none=True)
        assert gpu.memory_allocated() == base  # nothing leaked from the failed attempts


def test_resilient_step_uneven_micro_batches_cover_every_sample_once():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    oracle = copy.deepcopy(model)
    oracle_opt = torch.optim.SGD(oracle.parameters(), lr=0.5)
    x, y = batch(10)
    step = ResilientStep(model, opt, F.cross_entropy)
    step.micro_batch_size = 3  # chunks of 3, 3, 3, 1
    loss = step(x, y)
    expected = plain_step(oracle, oracle_opt, x, y)
    torch.testing.assert_close(loss, expected)
    for p, q in zip(model.parameters(), oracle.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_resilient_step_without_oom_is_a_plain_step_and_clips():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    oracle = copy.deepcopy(model)
    oracle_opt = torch.optim.SGD(oracle.parameters(), lr=0.5)
    x, y = batch(32)
    loss = ResilientStep(model, opt, F.cross_entropy, grad_clip=0.1)(x, y)
    oracle_opt.zero_grad()
    expected = F.cross_entropy(oracle(x), y)
    expected.backward()
    nn.utils.clip_grad_norm_(oracle.parameters(), 0.1)
    oracle_opt.step()
    torch.testing.assert_close(loss, expected.detach())
    for p, q in zip(model.parameters(), oracle.parameters()):
        torch.testing.assert_close(p, q)


def test_resilient_step_gives_up_clearly_when_one_sample_does_not_fit():
    model = SimpleCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.rand(8, 1, 28, 28), torch.randint(0, 10, (8,))
    params = sum(counted(p) for p in model.parameters())
    step = ResilientStep(model, opt, F.cross_entropy)
    with SimulatedGPU(params + 64 * 1024, model=model, optimizer=opt) as gpu:
        with pytest.raises(ResilientStepOutOfMemoryError, match="even with micro-batches of 1 sample") as info:
            step(x, y)
        assert isinstance(info.value, torch.OutOfMemoryError)
        del info
        assert step.oom_count == 4  # 8, 4, 2, 1
        assert gpu.memory_allocated() == params


def test_resilient_step_passes_other_errors_through():
    model = mlp()
    step = ResilientStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        step(torch.randn(4, 7), torch.zeros(4, dtype=torch.long))
    assert step.oom_count == 0
    with pytest.raises(ValueError, match="samples"):
        step(torch.randn(4, 20), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="grad_clip"):
        ResilientStep(model, step.optimizer, F.cross_entropy, grad_clip=0)
    with pytest.raises(TypeError, match="autocast"):
        ResilientStep(model, step.optimizer, F.cross_entropy, precision=object())


def test_resilient_step_honours_the_precision_protocol():
    amp = pytest.importorskip("course_utils.amp")
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oracle = copy.deepcopy(model)
    oracle_opt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    x, y = batch(64)
    precision = amp.MixedPrecision("cpu", dtype="bf16")
    step = ResilientStep(model, opt, F.cross_entropy, precision=precision, grad_clip=0.1)
    loss = step(x, y)
    oracle_opt.zero_grad()  # the oracle: bf16 autocast and clipping written out in plain PyTorch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.cross_entropy(oracle(x), y)
    expected.backward()
    norm = nn.utils.clip_grad_norm_(oracle.parameters(), 0.1)
    oracle_opt.step()
    assert torch.equal(loss, expected.detach())
    for p, q in zip(model.parameters(), oracle.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(step.step.grad_norm, norm) and norm > 0.1  # clipping really happened


def test_resilient_step_drives_the_trainer():
    from course_utils.data import TensorLoader
    from course_utils.trainer import Trainer

    model = mlp(width=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = batch(1024)

    def trainer_for(m, o, batch_size, **kwargs):
        loader = TensorLoader(x, y, batch_size=batch_size, shuffle=False)
        return Trainer(m, o, F.cross_entropy, loader, device="cpu", **kwargs)

    def epoch_peak(batch_size):
        m, o = clone_pair(model, opt)
        with SimulatedGPU("64GiB", model=m, optimizer=o) as gpu:
            trainer_for(m, o, batch_size)(1)
        return gpu.max_memory_allocated()

    budget = (epoch_peak(256) + epoch_peak(512)) // 2  # batches of 512 do not fit, 256 do
    oracle_trainer = trainer_for(*clone_pair(model, opt), 512)
    trainer = trainer_for(model, opt, 512, oom_recovery=True)
    with SimulatedGPU(budget, model=model, optimizer=opt):
        losses = trainer(2)
    expected = oracle_trainer(2)
    resilient = trainer.step
    assert isinstance(resilient, ResilientStep)
    assert resilient.oom_count >= 1 and resilient.micro_batch_size == 512 >> resilient.oom_count
    assert losses == pytest.approx(expected, rel=1e-5)
    for p, q in zip(model.parameters(), oracle_trainer.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# --- activation checkpointing -------------------------------------------------------------------------

def deep_mlp(seed=0):
    """8 blocks of 64 -> 256 -> 64 features: each block keeps 5 units of activations per sample."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64), nn.Tanh())
                           for _ in range(8)])


def grads_and_peak(model, x, forward):
    with SimulatedGPU("1GiB", model=model) as gpu:
        xb = x.clone()  # does not require grad: a non-reentrant checkpoint still gives parameter grads
        forward(model, xb).sum().backward()
        peak = gpu.max_memory_allocated()
    return [p.grad.clone() for p in model.parameters()], peak


def test_checkpointed_blocks_use_less_memory_and_give_the_same_gradients():
    x = torch.randn(512, 64)
    plain_grads, plain_peak = grads_and_peak(deep_mlp(), x, lambda m, t: m(t))
    wrapped = nn.Sequential(*[checkpointed(b) for b in deep_mlp()])
    ck_grads, ck_peak = grads_and_peak(wrapped, x, lambda m, t: m(t))
    seq_grads, seq_peak = grads_and_peak(deep_mlp(), x, lambda m, t: checkpoint_sequential_blocks(m, 4, t))
    assert ck_peak < 0.6 * plain_peak and seq_peak < 0.6 * plain_peak
    for a, b, c in zip(plain_grads, ck_grads, seq_grads):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c)


def test_checkpointing_passes_kwargs_and_is_plain_without_grad():
    class Scale(nn.Module):
        def forward(self, x, factor=1.0):
            return x * factor

    wrapped = checkpointed(Scale())
    x = torch.randn(3, requires_grad=True)
    out = wrapped(x, factor=3.0)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 3.0))
    with torch.no_grad():
        assert torch.equal(wrapped(x, factor=2.0), x * 2)
    with pytest.raises(TypeError, match="nn.Module"):
        checkpointed(lambda t: t)
    with pytest.raises(ValueError, match="segments"):
        checkpoint_sequential_blocks(deep_mlp(), 9, torch.randn(2, 64))


# --- hygiene ------------------------------------------------------------------------------------------

def test_import_has_no_side_effects():
    code = ("import threading, torch; n = threading.active_count(); import course_utils.memory; "
            "assert threading.active_count() == n; assert not torch.cuda.is_initialized()")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""


@no_cuda
def test_nothing_here_initialised_cuda():
    assert not torch.cuda.is_initialized()


def test_measure_peak_reports_the_blocks_peak_and_keeps_the_larger_outer_peak():
    """Exact byte sizes of the storages made inside (block_bytes=1) and PyTorch's own memory tracker
    as oracles for the block's peak; the GPU's overall peak survives the measurement."""
    with SimulatedGPU("1MiB", block_bytes=1) as gpu:
        big = torch.empty(50_000, dtype=torch.uint8)
        del big  # the overall peak so far: 50 000 bytes
        held = torch.empty(100, dtype=torch.float64)  # live when the block starts: counted in its peak
        with gpu.measure_peak() as reading:
            assert reading.bytes is None  # only known when the block ends
            a = torch.empty(1000)
            b = torch.ones(500, dtype=torch.int16)
            expected = sum(t.untyped_storage().nbytes() for t in (held, a, b))
            del a, b
            torch.empty(10)  # freed at once, below the peak
        assert reading.bytes == expected == 800 + 4000 + 1000
        assert gpu.max_memory_allocated() == 50_000  # the outer peak was higher: kept

        with gpu.measure_peak() as outer:  # a block that beats the outer peak raises it; blocks nest
            with gpu.measure_peak() as inner:
                c = torch.empty(20_000)
                del c
            d = torch.empty(100, dtype=torch.uint8)
        assert inner.bytes == outer.bytes == 800 + 80_000
        assert gpu.max_memory_allocated() == 80_800

        with pytest.raises(ValueError, match="inside"):  # the reading is set on error too
            with gpu.measure_peak() as failed:
                e = torch.empty(2500)
                raise ValueError("raised inside the block")
        assert failed.bytes == 800 + 100 + 10_000 and gpu.max_memory_allocated() == 80_800
        del d, e
        with pytest.raises(SimulatedOutOfMemoryError):
            with gpu.measure_peak() as oom:
                torch.empty(2**20)  # 4 MiB does not fit: refused, never part of the peak
        assert oom.bytes == 800 and gpu.memory_allocated() == 800

    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    torch.manual_seed(0)
    model = SimpleCNN()
    opt = OPTIMIZERS["adam"](model.parameters())
    x, y = torch.rand(32, 1, 28, 28), torch.randint(0, 10, (32,))
    plain_step(model, opt, x, y)  # optimizer state exists: the steady-state step
    tracker = mem_tracker.MemTracker()
    tracker.track_external(model, opt, x, y)
    with tracker:
        plain_step(model, opt, x, y)
    step_peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    with SimulatedGPU("1GiB", model=model, optimizer=opt, block_bytes=1) as gpu:
        gpu.track(x, y)
        spike = torch.empty(step_peak, dtype=torch.uint8)  # an earlier, higher peak
        outer_peak = gpu.max_memory_allocated()
        del spike
        with gpu.measure_peak() as reading:
            plain_step(model, opt, x, y)
    assert reading.bytes == step_peak
    assert gpu.max_memory_allocated() == outer_peak > step_peak


def test_simulated_oom_message_is_worded_as_this_torch_words_cuda_s():
    """The phrases of SimulatedGPU's message, in order, against the ones compiled into this torch's CUDA allocator."""
    import re
    from pathlib import Path

    lib = Path(torch.__file__).parent / "lib" / "libc10_cuda.so"
    if not lib.exists():
        pytest.skip("this torch has no CUDA allocator to compare with (a CPU-only build)")
    compiled = lib.read_bytes()
    phrases = ["CUDA out of memory. Tried to allocate ", ". GPU ", " has a total capacity of ", " of which ",
               " is free. ", "Of the allocated memory ", " is allocated by PyTorch, ", "and ",
               " is reserved by PyTorch but unallocated."]
    missing = [p for p in phrases if p.encode() + b"\0" not in compiled and p.encode() not in compiled]
    assert not missing, f"torch's CUDA message no longer has {missing}: update SimulatedGPU's"
    with SimulatedGPU("1MiB") as gpu:
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.zeros(2 ** 20)
    size = r"[0-9.]+ (?:bytes|KiB|MiB|GiB)"
    pattern = (re.escape(phrases[0]) + size + re.escape(phrases[1]) + r"\d+" + re.escape(phrases[2]) + size
               + re.escape(phrases[3]) + size + re.escape(phrases[4]) + re.escape(phrases[5]) + size
               + re.escape(phrases[6] + phrases[7]) + size + re.escape(phrases[8]))
    assert re.match(pattern, str(info.value)), str(info.value)
    assert gpu.oom_count == 1


class OomAbove(nn.Module):
    """Runs out of memory on batches larger than `limit`, after the layers before it ran (BatchNorm included)."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit

    def forward(self, x):
        if len(x) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return x


def test_resilient_step_puts_back_the_batchnorm_statistics_a_failed_attempt_changed():
    """The failed whole-batch attempt updated BatchNorm's running statistics before running out of memory; the
    retry in chunks must start from the statistics before it, like a step run in chunks from the start (the
    oracle). Also after the buffers were replaced by new tensors (what `model.to(...)` does)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 8), nn.BatchNorm1d(8), OomAbove(8), nn.ReLU(), nn.Linear(8, 5))
    oracle = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oracle_step = TrainStep(oracle, torch.optim.SGD(oracle.parameters(), lr=0.1), F.cross_entropy,
                            MixedPrecision("cpu", enabled=False))
    step = ResilientStep(model, opt, F.cross_entropy, regrow_after=1)  # whole batches again after each step
    x, y = batch(16)
    for replace in (False, True, False):
        if replace:  # new buffer tensors, same values: the guard must copy the new ones, not the old
            for bn in (model[1], oracle[1]):
                bn.running_mean = bn.running_mean.clone()
                bn.running_var = bn.running_var.clone()
        step(x, y)
        oracle_step.group([(x, y)], chunk_size=8)
        for name, b in model[1].named_buffers():
            assert torch.equal(b, dict(oracle[1].named_buffers())[name]), (replace, name)
        for p, q in zip(model.parameters(), oracle.parameters()):
            torch.testing.assert_close(p, q)
    assert step.oom_count == 3 and int(model[1].num_batches_tracked) == 6


def _not_put_back(step, x, y) -> list[str]:
    """Run `step` on (x, y); the warnings it gave about statistics it could not put back."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        step(x, y)
    return [str(w.message) for w in record if "not put back" in str(w.message)]


@pytest.mark.parametrize("replaced", ["running_mean", "running_var", "num_batches_tracked"])
def test_resilient_step_names_a_single_buffer_replaced_by_hand_and_puts_back_the_others(replaced):
    """The guard tests only the first buffer each step (what `model.to` replaces with all the others): the first
    one assigned anew by hand is noticed there, and everything is put back. Another one is found when the
    statistics are put back: the others are put back exactly (the oracle: a step run in chunks from the start),
    that one keeps the failed attempt's update, and a warning names it. The next failed step puts back
    everything again."""
    noticed_early = replaced == "running_mean"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 8), nn.BatchNorm1d(8), OomAbove(8), nn.ReLU(), nn.Linear(8, 5))
    oracle = copy.deepcopy(model)
    oracle_step = TrainStep(oracle, torch.optim.SGD(oracle.parameters(), lr=0.1), F.cross_entropy,
                            MixedPrecision("cpu", enabled=False))
    step = ResilientStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, regrow_after=1)
    x, y = batch(16)
    step(x, y)
    oracle_step.group([(x, y)], chunk_size=8)
    for bn in (model[1], oracle[1]):
        setattr(bn, replaced, getattr(bn, replaced).clone())
    said = _not_put_back(step, x, y)
    assert len(said) == (0 if noticed_early else 1), said
    if not noticed_early:
        assert f"running statistics 1.{replaced} were not put back" in said[0], said
    oracle_step.group([(x, y)], chunk_size=8)
    ours, theirs = dict(model[1].named_buffers()), dict(oracle[1].named_buffers())
    for name in ours:
        assert torch.equal(ours[name], theirs[name]) == (noticed_early or name != replaced), name
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for bn in (model[1], oracle[1]):  # start the two from the same statistics again
            for name, b in bn.named_buffers():
                b.copy_(dict(oracle[1].named_buffers())[name])
        step(x, y)
    oracle_step.group([(x, y)], chunk_size=8)
    for name, b in model[1].named_buffers():
        assert torch.equal(b, dict(oracle[1].named_buffers())[name]), name
    assert step.oom_count == 3


@pytest.mark.parametrize("change", ["module_swapped", "module_added", "partial_to", "lazy_first_step"])
def test_resilient_step_names_statistics_that_are_new_since_they_were_copied(change):
    """What the per-step test of the first buffer does not see is found when the statistics are put back, by
    walking the model again: a BatchNorm module swapped in or added after the first step, a `.double()` that left
    the first module's buffers (already float64) in place, a lazy module's first step. Those statistics keep the
    failed attempt's update, a warning names exactly them, the others are put back exactly, and the next failed
    step puts back everything (the oracle: the same steps run in chunks from the start)."""
    class In64(nn.Module):  # a BatchNorm kept in float64 inside a float32 model
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x.double()).to(x.dtype)

    def make():
        torch.manual_seed(0)
        first = In64(nn.BatchNorm1d(8).double()) if change == "partial_to" else nn.BatchNorm1d(8)
        second = nn.LazyBatchNorm1d() if change == "lazy_first_step" else nn.BatchNorm1d(8)
        return nn.Sequential(nn.Linear(20, 8), first, nn.Linear(8, 8),
                             nn.Identity() if change == "module_added" else second, OomAbove(8), nn.Linear(8, 5))

    model = make()
    x, y = batch(16)
    step = ResilientStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, regrow_after=1)
    if change != "lazy_first_step":
        step(x[:8], y[:8])  # a first step that fits: the guard finds the statistics there
    if change in ("module_swapped", "module_added"):
        model[3] = nn.BatchNorm1d(8)
    if change == "partial_to":
        model.double()
        x = x.double()
    oracle = make() if change == "lazy_first_step" else copy.deepcopy(model)  # (a lazy module cannot be copied)
    oracle_step = TrainStep(oracle, torch.optim.SGD(oracle.parameters(), lr=0.1), F.cross_entropy,
                            MixedPrecision("cpu", enabled=False))
    said = _not_put_back(step, x, y)
    # (.double() leaves an int64 counter as it was; a lazy module's counter has a value from the start)
    new = ["3.running_mean", "3.running_var"] + (["3.num_batches_tracked"] if "module" in change else [])
    assert len(said) == 1 and f"statistics {', '.join(new)} were not put back" in said[0], said
    oracle_step.group([(x, y)], chunk_size=8)
    ours, theirs = dict(model.named_buffers()), dict(oracle.named_buffers())
    for name in ours:
        assert torch.equal(ours[name], theirs[name]) == (name not in new), name
    for m in (model, oracle):  # the same statistics again, then a second failed step: all put back
        m.load_state_dict(ours, strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(x, y)
    oracle_step.group([(x, y)], chunk_size=8)
    for name, b in model.named_buffers():
        assert torch.equal(b, dict(oracle.named_buffers())[name]), name
