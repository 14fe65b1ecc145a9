"""Sharded data parallelism with FSDP2 (`torch.distributed.fsdp.fully_shard`): each rank keeps 1/N of every parameter.

    torchrun --nproc-per-node 2 -m course_utils.examples.fsdp_shards --out shards.json [--device cpu]

Every rank builds the same MLP (same seed), then `fully_shard` wraps each Linear layer and the whole model: every
parameter becomes a DTensor sharded on dim 0, and this rank keeps only its rows (`p.to_local()`). One SGD step on
this rank's half of a global batch follows: the forward all-gathers each layer's parameters just before it runs
(and frees them after), the backward all-gathers them again and reduce-scatters the gradients, so each rank gets the
averaged gradient of its own shard only, and the optimizer updates that shard. Rank 0 then gathers the full weights
and compares them with one plain step on the whole global batch in one process. With `--checkpoint DIR` every rank
also saves its shards there with `torch.distributed.checkpoint`. Rank 0 writes the figures (JSON).

The log of collectives (`"collectives"` in the JSON) is written in the language course_utils speaks (the launching
kernel's, through `COURSE_UTILS_LANG`); `phases(log)` and `collective_bytes(lines, name)` read it in either language.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from course_utils import distributed
from course_utils.i18n import LANGUAGES, N_, _, speaking


def build_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 300), nn.ReLU(), nn.Linear(300, 300), nn.ReLU(),
                         nn.Linear(300, 10))


def global_batch(size: int = 32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(size, 1, 28, 28, generator=g), torch.randint(0, 10, (size,), generator=g)


FORWARD_DONE = N_("forward done")
BACKWARD_DONE = N_("backward done")
COLLECTIVE_LINE = N_("{collective} {bytes} bytes in")  # the name and the byte count stay the first two words


def _in_every_language(message: str) -> set[str]:
    texts = set()
    for language in LANGUAGES:
        with speaking(language):
            texts.add(_(message))
    return texts


def phases(log: list[str]) -> tuple[list[str], list[str]]:
    """(the collectives before the forward's end, those between it and the backward's end) of a `collectives` log,
    written in any language course_utils speaks."""
    forward_done, backward_done = _in_every_language(FORWARD_DONE), _in_every_language(BACKWARD_DONE)
    end_forward = next(i for i, line in enumerate(log) if line in forward_done)
    end_backward = next(i for i, line in enumerate(log) if i > end_forward and line in backward_done)
    return log[:end_forward], log[end_forward + 1:end_backward]


def collective_bytes(lines: list[str], collective: str) -> list[int]:
    """The byte counts of the `collective` ("all_gather" or "reduce_scatter") lines among `lines`, sorted."""
    return sorted(int(line.split()[1]) for line in lines if line.split()[0] == collective)


def one_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, log: list | None = None) -> None:
    """One SGD step; with `log`, the collectives FSDP launched so far are appended after the forward and after the
    backward."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    if log is not None:
        log.append(_(FORWARD_DONE))
    loss.backward()
    if log is not None:
        log.append(_(BACKWARD_DONE))
    optimizer.step()


class CountCollectives:
    """Wraps the two collectives FSDP2 calls (`dist.all_gather_single`, `dist.reduce_scatter_single`) to log them."""

    NAMES = ("all_gather_single", "reduce_scatter_single")

    def __init__(self, log: list):
        self.log = log

    def __enter__(self):
        self.saved = {name: getattr(dist, name) for name in self.NAMES}
        for name, fn in self.saved.items():
            setattr(dist, name, self._logged(name, fn))
        return self

    def _logged(self, name, fn):
        def wrapper(output, input, *args, **kwargs):
            self.log.append(_(COLLECTIVE_LINE).format(collective=name.replace("_single", ""),
                                                      bytes=input.numel() * input.element_size()))
            return fn(output, input, *args, **kwargs)
        return wrapper

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)
        return False


def build_reference_init() -> dict:
    torch.manual_seed(0)
    return build_mlp().state_dict()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--checkpoint", default=None, help="save the sharded weights here (torch.distributed.checkpoint)")
    args = parser.parse_args(argv)
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    process = distributed.setup(device_type)
    if process is None:
        raise SystemExit(_("launch this with torchrun and 2 or more processes"))
    device = distributed.device_for(process, device_type)

    torch.manual_seed(0)
    model = build_mlp().to(device)
    full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    # The mesh names the device explicitly: fully_shard's default is the accelerator whenever there is one.
    mesh = init_device_mesh(device.type, (process.world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)  # one unit per layer: all-gathered just before it runs, freed after
    fully_shard(model, mesh=mesh)
    params = dict(model.named_parameters())
    shards = {name: {"full": full_shapes[name], "local": tuple(p.to_local().shape),
                     "placement": str(p.placements[0]), "type": type(p).__name__} for name, p in params.items()}

    x, y = global_batch()
    mine = slice(process.rank, None, process.world_size)  # this rank's half of the global batch
    log: list[str] = []
    with CountCollectives(log):
        one_step(model, x[mine].to(device), y[mine].to(device), log)
    grad_local = {name: tuple(p.grad.to_local().shape) for name, p in params.items()}
    local_numel = sum(p.to_local().numel() for p in params.values())

    if args.checkpoint:  # every rank writes its own shards: nothing is gathered for this
        import torch.distributed.checkpoint as dcp
        dcp.save({"model": model.state_dict()}, checkpoint_id=args.checkpoint)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    per_rank = distributed.gather_objects({"rank": process.rank, "shards": shards, "grad_local": grad_local,
                                           "local_numel": local_numel, "collectives": log}, process)
    result = {"world_size": process.world_size, "backend": process.backend, "ranks": per_rank}
    if process.is_main:
        torch.manual_seed(0)
        reference = build_mlp()
        one_step(reference, x, y)  # one process, the whole global batch
        expected = reference.state_dict()
        result["full_numel"] = sum(v.numel() for v in expected.values())
        result["max_difference_from_one_process"] = max((full[k] - expected[k]).abs().max().item() for k in expected)
        if args.checkpoint:
            result["checkpoint_files"] = {f.name: f.stat().st_size for f in sorted(Path(args.checkpoint).iterdir())}
        result["changed"] = max((full[k] - build_reference_init()[k]).abs().max().item() for k in expected)
        print(json.dumps({k: v for k, v in result.items() if k != "ranks"}), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
