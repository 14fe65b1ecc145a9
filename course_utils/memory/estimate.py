"""`estimate_training_memory`: one training step's memory, computed on fake tensors."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..i18n import N_, _, pad
from ..errors import first_line
from .simulated import AllocationTracker, StorageLedger, optimizer_params
from .sizes import CUDA_BLOCK_BYTES, format_bytes


# --- predicting memory ---------------------------------------------------------------------

@dataclass
class MemoryEstimate:
    """Predicted memory of one training step (steady state: optimizer state already created).

    `total` (the predicted peak) = parameters + batch + optimizer_state + library_workspace
    + max(forward/backward peak, gradients + step_temporaries), where the forward/backward peak is
    `activations` plus the gradients already accumulated at that moment.
    """
    parameters: int          # parameters and buffers
    gradients: int           # one per trainable parameter
    optimizer_state: int
    activations: int         # saved for backward + temporaries, at the forward/backward peak
    step_temporaries: int    # extra memory inside optimizer.step()
    batch: int               # inputs and targets on the device
    forward_backward_peak: int
    library_workspace: int   # cuBLAS workspace on CUDA (allocated once per stream), else 0
    total: int
    optimizer_kind: str
    state_source: str        # how optimizer_state was obtained
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        rows = [(_("parameters (and buffers)"), self.parameters, ""),
                (_("gradients"), self.gradients, ""),
                (_("optimizer state"), self.optimizer_state, self.state_source),
                (_("activations"), self.activations, _("at the forward/backward peak (fake tensors)")),
                (_("optimizer step temporaries"), self.step_temporaries, ""),
                (_("batch (inputs + targets)"), self.batch, ""),
                (_("cuBLAS workspace"), self.library_workspace, ""),
                (_("predicted peak"), self.total, _("= parameters + batch + state + workspace"
                                                    " + max(fwd/bwd peak, gradients + step temporaries)"))]
        lines = [_("Training memory estimate ({optimizer}):").format(optimizer=_(self.optimizer_kind))]
        lines += [f"  {pad(name, 28)}{pad(format_bytes(n), 12, '>')}  {note}".rstrip() for name, n, note in rows]
        lines += [_("  note: {note}").format(note=n) for n in self.notes]
        return "\n".join(lines)

    __repr__ = __str__


def _optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.SGD):
        moms = {g.get("momentum", 0) for g in optimizer.param_groups}
        return N_("SGD with momentum") if any(m for m in moms) else "SGD"
    return name


def _analytic_state(optimizer: torch.optim.Optimizer, count: Callable[[int], int]) -> tuple[int, str] | None:
    """Optimizer state bytes for the optimizers the course uses; None for others."""
    def nbytes(p):
        return count(p.numel() * p.element_size())

    total = 0
    if type(optimizer) is torch.optim.SGD:
        for g in optimizer.param_groups:
            if g.get("momentum", 0):
                total += sum(nbytes(p) for p in g["params"] if p.requires_grad)
        return total, (_("SGD with momentum: 1 buffer per parameter") if total else _("SGD: no state"))
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        for g in optimizer.param_groups:
            per = 3 if g.get("amsgrad") else 2
            on_device = bool(g.get("capturable") or g.get("fused"))
            for p in g["params"]:
                if not p.requires_grad:
                    continue
                total += per * nbytes(p)
                if on_device or p.device.type == "cpu":  # `step` is a scalar tensor, on the CPU unless
                    total += count(4)                    # capturable/fused
        return total, _("{optimizer}: 2 buffers per parameter (3 with amsgrad)").format(
            optimizer=type(optimizer).__name__)
    return None


def _example_parts(example_batch):
    if isinstance(example_batch, torch.Tensor):
        return example_batch, None
    if isinstance(example_batch, (tuple, list)) and len(example_batch) == 2:
        return example_batch[0], example_batch[1]
    raise TypeError(_("example_batch must be the inputs tensor or a pair (inputs, targets)"))


def estimate_training_memory(model: nn.Module, optimizer: torch.optim.Optimizer, example_batch,
                             loss_fn: Callable | None = None, *, autocast_dtype: torch.dtype | None = None,
                             block_bytes: int = CUDA_BLOCK_BYTES) -> MemoryEstimate:
    """Predict the peak memory of a training step on `example_batch` without running it for real.

    Parameters, gradients and optimizer state come from the parameters' sizes (state by optimizer
    kind: SGD none, momentum 1x, Adam/AdamW 2x; other optimizers: measured by running their step on
    fake tensors). Activations and temporaries come from running two training steps (forward, loss,
    backward, optimizer step) of a fake copy of the model under `FakeTensorMode`: shapes and dtypes
    are real, no data memory is allocated, the real model and optimizer are not touched.

    `example_batch` is the inputs tensor or (inputs, targets); `loss_fn(outputs, targets)` defaults
    to `outputs.sum()`. `autocast_dtype` (e.g. torch.bfloat16) runs the forward pass under autocast.
    Each tensor is rounded up to `block_bytes`, as CUDA's allocator does. Not included: the CUDA
    context, cuBLAS/cuDNN workspaces and kernels' scratch buffers, allocator fragmentation.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(_("model must be an nn.Module, got {kind}").format(kind=type(model).__name__))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(_("optimizer must be a torch.optim.Optimizer, got {kind}").format(
            kind=type(optimizer).__name__))
    inputs, targets = _example_parts(example_batch)
    if not isinstance(inputs, torch.Tensor) or (targets is not None and not isinstance(targets, torch.Tensor)):
        raise TypeError(_("example_batch must hold tensors: inputs, or (inputs, targets)"))
    ledger = StorageLedger(block_bytes)
    count = ledger.count
    notes: list[str] = []
    try:
        fake = _fake_training_run(model, optimizer, inputs, targets, loss_fn or _sum_loss, autocast_dtype, ledger)
    except Exception as exc:
        raise RuntimeError(_("could not run a training step of {model} on fake tensors with this example batch: "
                             "{error}").format(model=type(model).__name__, error=first_line(exc))) from exc
    kind = _optimizer_kind(optimizer)  # stored in English (a name); shown translated
    analytic = _analytic_state(optimizer, count)
    if analytic is not None:
        state, source = analytic
    elif "step_error" not in fake:
        state, source = fake["state"], _("{optimizer}: measured by a step on fake tensors").format(optimizer=_(kind))
    else:
        state, source = 0, _("{optimizer}: unknown").format(optimizer=_(kind))
        notes.append(_("{optimizer}'s step could not run on fake tensors ({error}): its state and temporaries are "
                       "not included").format(optimizer=_(kind), error=fake["step_error"]))
    grads = sum(count(p.numel() * p.element_size()) for p in model.parameters() if p.requires_grad)
    workspace = 0
    first = next(iter(model.parameters()), None)
    if first is not None and first.device.type == "cuda":
        get_size = getattr(torch._C, "_cuda_getCublasWorkspaceSize", None)  # private; may move
        workspace = int(get_size()) if callable(get_size) else 0
        notes.append(_("on CUDA also: cuDNN convolution workspaces (chosen per algorithm) and allocator "
                       "fragmentation, not included"))
    fb_peak, step_tmp = fake["fb_peak"], fake["step_tmp"]
    total = fake["params"] + fake["batch"] + state + workspace + max(fb_peak, grads + step_tmp)
    return MemoryEstimate(parameters=fake["params"], gradients=grads, optimizer_state=state,
                          activations=max(fb_peak - fake["grads_at_peak"], 0), step_temporaries=step_tmp,
                          batch=fake["batch"], forward_backward_peak=fb_peak, library_workspace=workspace,
                          total=total, optimizer_kind=kind, state_source=source, notes=notes)


def _sum_loss(outputs: torch.Tensor, _targets) -> torch.Tensor:
    return outputs.sum()


def _fake_optimizer(optimizer: torch.optim.Optimizer, fake_of: dict[int, torch.Tensor]):
    """A new optimizer of the same class and hyperparameters over the fake parameters. The
    foreach/fused choice is made for the real parameters (it would default differently for fakes)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    groups = []
    for g in optimizer.param_groups:
        fg = {k: v for k, v in g.items() if k != "params"}
        fg["params"] = [fake_of[id(p)] for p in g["params"]]
        if "foreach" in g and g.get("foreach") is None and not g.get("fused"):
            _fused, foreach = _default_to_fused_or_foreach([p for p in g["params"]], bool(g.get("differentiable")))
            fg["foreach"] = foreach
        groups.append(fg)
    try:
        return type(optimizer)(groups, **optimizer.defaults)
    except TypeError:
        return type(optimizer)(groups)


def _fake_training_run(model, optimizer, inputs, targets, loss_fn, autocast_dtype, ledger) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    fm = FakeTensorMode(allow_non_fake_inputs=True)
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    fake_of: dict[int, torch.Tensor] = {}
    fake_state: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        if id(t) not in fake_of:
            fake_of[id(t)] = fm.from_tensor(t)
        fake_state[name] = fake_of[id(t)]
    fake_inputs = fm.from_tensor(inputs)
    fake_targets = fm.from_tensor(targets) if targets is not None else None
    fake_params = [fake_of[id(p)] for p in model.parameters()]
    result: dict[str, Any] = {}
    grads_at_peak = [0]

    def on_peak():
        grads_at_peak[0] = sum(ledger.count(p.grad.untyped_storage().nbytes())
                               for p in fake_params if p.grad is not None)

    mode = AllocationTracker(ledger, count_meta=True, on_peak=on_peak)
    device_type = inputs.device.type

    with fm, mode:
        def register(ts):
            return sum(ledger.track(t.untyped_storage()) for t in ts)

        result["params"] = register(fake_of.values())
        result["batch"] = register([t for t in (fake_inputs, fake_targets) if t is not None])
        missing = [id(p) for p in optimizer_params(optimizer) if id(p) not in fake_of]
        for pid in missing:  # optimizer parameters that are not the model's
            p = next(q for q in optimizer_params(optimizer) if id(q) == pid)
            fake_of[pid] = fm.from_tensor(p)
        try:
            fake_opt = _fake_optimizer(optimizer, fake_of)
        except Exception as exc:  # an optimizer that cannot be rebuilt this way
            fake_opt, result["step_error"] = None, first_line(exc)

        def forward_backward():
            if autocast_dtype is not None:
                with torch.autocast(device_type, dtype=autocast_dtype):
                    out = functional_call(model, fake_state, (fake_inputs,))
                    loss = loss_fn(out, fake_targets)
            else:
                out = functional_call(model, fake_state, (fake_inputs,))
                loss = loss_fn(out, fake_targets)
            del out
            loss.backward()
            return loss

        def zero_grad():
            for p in fake_of.values():
                p.grad = None

        # step 1 creates the optimizer state; step 2 is the steady state we predict
        loss = forward_backward()
        if fake_opt is not None:
            try:
                fake_opt.step()
            except Exception as exc:
                fake_opt, result["step_error"] = None, first_line(exc)
        del loss
        zero_grad()
        base = ledger.allocated
        result["state"] = base - result["params"] - result["batch"]
        ledger.reset_peak()
        grads_at_peak[0] = 0
        loss = forward_backward()
        result["fb_peak"] = ledger.peak - base
        result["grads_at_peak"] = grads_at_peak[0]
        before_step = ledger.allocated
        ledger.reset_peak()
        if fake_opt is not None:
            fake_opt.step()
        result["step_tmp"] = ledger.peak - before_step
        del loss
        zero_grad()
    return result
