"""Activation checkpointing: recompute activations in the backward pass instead of keeping them (PyTorch calls it
checkpointing; this module is named for what it does, apart from `course_utils.checkpoint`, the checkpoint files).
Always with `use_reentrant=False`."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..i18n import _


# --- activation checkpointing ----------------------------------------------------------------

class Checkpointed(nn.Module):
    """Runs `module` under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` when
    gradients are being recorded: its inner activations are recomputed in backward instead of kept.
    The state_dict keys gain a "module." prefix."""

    def __init__(self, module: nn.Module, preserve_rng_state: bool = True):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(_("checkpointed() wraps an nn.Module, got {kind}").format(kind=type(module).__name__))
        self.module = module
        self.preserve_rng_state = preserve_rng_state

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)  # nothing would be saved anyway
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.module, *args, use_reentrant=False,
                          preserve_rng_state=self.preserve_rng_state, **kwargs)


def checkpointed(module: nn.Module, preserve_rng_state: bool = True) -> Checkpointed:
    """Wrap `module` so that its activations are recomputed in backward (non-reentrant checkpoint)."""
    return Checkpointed(module, preserve_rng_state)


def checkpoint_sequential_blocks(blocks: nn.Sequential | Sequence[nn.Module], segments: int,
                                 input: torch.Tensor, preserve_rng_state: bool = True) -> torch.Tensor:
    """Run `blocks` in `segments` checkpointed segments (`torch.utils.checkpoint.checkpoint_sequential`
    with use_reentrant=False): only segment boundaries are kept for backward."""
    from torch.utils.checkpoint import checkpoint_sequential
    n = len(blocks)
    if not isinstance(segments, int) or not 1 <= segments <= max(n, 1):
        raise ValueError(_("segments must be an int between 1 and the number of blocks ({n}), got {segments!r}").format(
            n=n, segments=segments))
    if not torch.is_grad_enabled():
        for b in blocks:
            input = b(input)
        return input
    return checkpoint_sequential(blocks if isinstance(blocks, nn.Sequential) else list(blocks), segments,
                                 input, use_reentrant=False, preserve_rng_state=preserve_rng_state)
