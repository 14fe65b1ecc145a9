"""Datasets that work offline, and a loader for data that already sits in memory.

- `synthetic_digits(n)`: MNIST-shaped (1x28x28) handwriting-like digits drawn from strokes with random
  affine jitter, stroke width and noise. Deterministic for a seed, learnable, no download.
- `synthetic_cifar(n)`: CIFAR-shaped (3x32x32) coloured shapes in 10 classes, same idea.
- `load_mnist(root)` / `load_cifar10(root)`: the real datasets through torchvision when the files are
  there or can be downloaded; otherwise one clear sentence and the synthetic stand-in.
- `AugmentedImages`: images with a random crop, flip and noise in `__getitem__`: per-sample CPU work, the
  kind DataLoader worker processes exist for (notebook 03).
- `TensorLoader`: batches straight from tensors (optionally resident on the GPU), reshuffled each epoch.
"""
from __future__ import annotations

import copy
import math
import socket

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from .errors import message_line
from .i18n import _

DIGIT_CLASSES = [str(d) for d in range(10)]
SHAPE_CLASSES = ["disk", "square", "triangle", "ring", "plus", "h-bars", "v-bars", "x-cross", "checker", "two-dots"]


class ImageDataset(Dataset):
    """Images (N, C, H, W) float32 in [0, 1] and integer labels, held in memory."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, classes: list[str], source: str):
        if len(images) != len(labels):
            raise ValueError(_("{images} images but {labels} labels").format(images=len(images), labels=len(labels)))
        self.images = images
        self.labels = labels
        self.classes = classes
        self.source = source  # "synthetic" or the torchvision dataset it came from

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]

    def __repr__(self) -> str:
        c, h, w = self.images.shape[1:]
        return f"ImageDataset({len(self)} images {c}x{h}x{w}, {len(self.classes)} classes, source={self.source!r})"


# --- synthetic digits ------------------------------------------------------------------

def _arc(cx, cy, rx, ry, a0, a1, k=10):
    """Points on an elliptical arc from angle a0 to a1 (degrees, 0 = right, 90 = down)."""
    return [(cx + rx * math.cos(math.radians(a0 + (a1 - a0) * i / k)),
             cy + ry * math.sin(math.radians(a0 + (a1 - a0) * i / k))) for i in range(k + 1)]


# Each digit is a list of strokes; each stroke a polyline in a unit box (x right, y down).
_STROKES = {
    0: [_arc(0.5, 0.5, 0.26, 0.38, 0, 360, 16)],
    1: [[(0.36, 0.24), (0.52, 0.1), (0.52, 0.9)]],
    2: [_arc(0.5, 0.32, 0.24, 0.2, 190, 380, 8) + [(0.26, 0.9), (0.78, 0.9)]],
    3: [_arc(0.48, 0.3, 0.22, 0.19, 200, 450, 8), _arc(0.48, 0.69, 0.25, 0.21, 270, 520, 8)],
    4: [[(0.62, 0.9), (0.62, 0.1), (0.2, 0.64), (0.8, 0.64)]],
    5: [[(0.74, 0.1), (0.32, 0.1), (0.28, 0.46)] + _arc(0.48, 0.65, 0.25, 0.24, 240, 500, 9)],
    6: [[(0.68, 0.1)] + _arc(0.62, 0.55, 0.34, 0.45, 240, 180, 4) + _arc(0.5, 0.68, 0.22, 0.22, 180, 540, 12)],
    7: [[(0.22, 0.12), (0.78, 0.12), (0.44, 0.9)]],
    8: [_arc(0.5, 0.3, 0.19, 0.19, 0, 360, 12), _arc(0.5, 0.7, 0.23, 0.21, 0, 360, 12)],
    9: [_arc(0.5, 0.33, 0.21, 0.22, 0, 360, 12), [(0.71, 0.33), (0.62, 0.9)]],
}


def _segments() -> torch.Tensor:
    """(10, S, 4) segment endpoints per digit, padded with far-away dummies."""
    per_digit = []
    for d in range(10):
        segs = [(*a, *b) for stroke in _STROKES[d] for a, b in zip(stroke[:-1], stroke[1:])]
        per_digit.append(segs)
    s_max = max(len(s) for s in per_digit)
    out = torch.full((10, s_max, 4), 50.0)  # a dummy segment far outside the image never lights a pixel
    for d, segs in enumerate(per_digit):
        out[d, : len(segs)] = torch.tensor(segs)
    return out


def _render_strokes(seg: torch.Tensor, width: torch.Tensor, size: int) -> torch.Tensor:
    """Rasterise (N, S, 4) segments in pixel units with per-sample stroke width (N,) into (N, size, size)."""
    coords = torch.arange(size, dtype=torch.float32) + 0.5
    py, px = torch.meshgrid(coords, coords, indexing="ij")
    p = torch.stack([px.reshape(-1), py.reshape(-1)], dim=-1)  # (P, 2)
    a, b = seg[..., None, :2], seg[..., None, 2:]  # (N, S, 1, 2)
    ab = b - a
    ap = p - a  # (N, S, P, 2)
    t = ((ap * ab).sum(-1) / (ab * ab).sum(-1).clamp_min(1e-6)).clamp(0, 1)
    dist = (ap - t[..., None] * ab).norm(dim=-1).amin(dim=1)  # (N, P): distance to the nearest stroke
    ink = ((width[:, None] - dist) / 0.9 + 0.5).clamp(0, 1)  # anti-aliased edge about one pixel wide
    return ink.reshape(-1, size, size)


def _digit_templates(size: int = 56, widths=(1.6, 2.4, 3.2)) -> torch.Tensor:
    """(10, len(widths), size, size) clean renderings of each digit at a few stroke widths."""
    base = _segments()
    far = base[..., :1] > 10
    seg = torch.where(far, torch.full_like(base, 1e3), base * size * 20 / 28 + size * 4 / 28)
    out = torch.empty(10, len(widths), size, size)
    for j, w in enumerate(widths):
        out[:, j] = _render_strokes(seg, torch.full((10,), w * size / 28), size)
    return out


def synthetic_digits(n: int = 10_000, seed: int = 0) -> ImageDataset:
    """`n` handwriting-like digits, 1x28x28 in [0, 1], balanced labels 0-9, deterministic for `seed`.

    Each digit is drawn from strokes at a random stroke width, then warped by a random affine map
    (rotation, scale, shear, shift) plus a smooth random "elastic" displacement, dimmed and speckled
    with noise, so a model must learn shapes rather than pixels. 60k digits take a few seconds.
    """
    if n < 1:
        raise ValueError(_("n must be at least 1, got {n}").format(n=n))
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 10
    labels = labels[torch.randperm(n, generator=g)]
    templates = _digit_templates()
    images = torch.empty(n, 1, 28, 28)
    chunk = 8192
    for start in range(0, n, chunk):
        lab = labels[start:start + chunk]
        m = len(lab)
        width = torch.randint(0, templates.shape[1], (m,), generator=g)
        src = templates[lab, width][:, None]  # (m, 1, 56, 56)
        angle = (torch.rand(m, generator=g) - 0.5) * math.radians(30)
        scale = 1 / (0.8 + 0.3 * torch.rand(m, generator=g))
        aspect = 0.85 + 0.3 * torch.rand(m, generator=g)
        shear = (torch.rand(m, generator=g) - 0.5) * 0.5
        cos, sin = angle.cos(), angle.sin()
        theta = torch.zeros(m, 2, 3)
        theta[:, 0, 0] = cos * scale * aspect
        theta[:, 0, 1] = (-sin + shear * cos) * scale
        theta[:, 1, 0] = sin * scale * aspect
        theta[:, 1, 1] = (cos + shear * sin) * scale
        theta[:, :, 2] = (torch.rand(m, 2, generator=g) - 0.5) * 0.25
        grid = F.affine_grid(theta, (m, 1, 28, 28), align_corners=False)
        wobble = F.interpolate(torch.randn(m, 2, 4, 4, generator=g) * 0.05, size=(28, 28), mode="bicubic",
                               align_corners=False)
        grid = grid + wobble.permute(0, 2, 3, 1)  # smooth "elastic" displacement, like a hand's wobble
        img = F.grid_sample(src, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        img = img * (0.75 + 0.25 * torch.rand(m, 1, 1, 1, generator=g))
        img = img + 0.08 * torch.rand(img.shape, generator=g) * (torch.rand(img.shape, generator=g) < 0.1)
        images[start:start + m] = img.clamp(0, 1)
    return ImageDataset(images, labels, DIGIT_CLASSES, "synthetic")


# --- synthetic CIFAR-shaped shapes --------------------------------------------------------

def synthetic_cifar(n: int = 10_000, seed: int = 0) -> ImageDataset:
    """`n` coloured shapes, 3x32x32 in [0, 1], 10 balanced classes (see SHAPE_CLASSES).

    Random position, size, rotation, foreground and background colours and noise; the class is the shape.
    """
    if n < 1:
        raise ValueError(_("n must be at least 1, got {n}").format(n=n))
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 10
    labels = labels[torch.randperm(n, generator=g)]
    coords = (torch.arange(32, dtype=torch.float32) + 0.5) / 32 - 0.5
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    cx = (torch.rand(n, 1, 1, generator=g) - 0.5) * 0.3
    cy = (torch.rand(n, 1, 1, generator=g) - 0.5) * 0.3
    r = 0.2 + 0.12 * torch.rand(n, 1, 1, generator=g)
    ang = torch.rand(n, 1, 1, generator=g) * math.pi / 6 - math.pi / 12
    x0, y0 = xx - cx, yy - cy
    u = x0 * ang.cos() + y0 * ang.sin()
    v = -x0 * ang.sin() + y0 * ang.cos()
    rad = (u ** 2 + v ** 2).sqrt()
    inside = (u.abs() < r) & (v.abs() < r)
    period = r / 2
    masks = [
        rad < r,                                                      # disk
        inside,                                                       # square
        (v < r * 0.8) & (v > -r) & (u.abs() < (v + r) * 0.55),        # triangle
        (rad < r) & (rad > r * 0.55),                                 # ring
        ((u.abs() < r * 0.3) | (v.abs() < r * 0.3)) & inside,         # plus
        inside & (torch.remainder(v, period) < period / 2),           # horizontal bars
        inside & (torch.remainder(u, period) < period / 2),           # vertical bars
        (((u - v).abs() < r * 0.28) | ((u + v).abs() < r * 0.28)) & inside,  # x-cross
        inside & ((torch.remainder(u, period) < period / 2) ^ (torch.remainder(v, period) < period / 2)),  # checker
        (((u - r * 0.5) ** 2 + v ** 2).sqrt() < r * 0.4) | (((u + r * 0.5) ** 2 + v ** 2).sqrt() < r * 0.4),  # dots
    ]
    mask = torch.stack(masks, 1)[torch.arange(n), labels].float()  # (n, 32, 32)
    fg = torch.rand(n, 3, 1, 1, generator=g)
    bg = torch.rand(n, 3, 1, 1, generator=g)
    # push the colours apart so the shape is always visible
    flip = (fg - bg).abs().mean(1, keepdim=True) < 0.3
    bg = torch.where(flip, 1 - fg, bg)
    images = bg + (fg - bg) * mask[:, None]
    images = images + 0.06 * torch.randn(images.shape, generator=g)
    return ImageDataset(images.clamp(0, 1).contiguous(), labels, SHAPE_CLASSES, "synthetic")


# --- real datasets with an offline fallback -----------------------------------------------

def _load_torchvision(name: str, root, train: bool, download: bool):
    import torchvision

    cls = getattr(torchvision.datasets, name)
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(15)  # an offline machine should say so quickly, not hang on a download
    try:
        return cls(root=str(root), train=train, download=download)
    finally:
        socket.setdefaulttimeout(old)


def load_mnist(root="data", train: bool = True, download: bool = True, fallback_size: int | None = None) -> ImageDataset:
    """Real MNIST through torchvision if present or downloadable, else synthetic digits (with one sentence why)."""
    try:
        ds = _load_torchvision("MNIST", root, train, download)
    except Exception as exc:  # no files and no network, a corrupt file, ...
        n = fallback_size or (60_000 if train else 10_000)
        print(_("MNIST is not available under {root} ({error}: {message}); using {n} synthetic digits instead."
                ).format(root=root, error=type(exc).__name__, message=message_line(exc)[:120], n=n))
        return synthetic_digits(n, seed=0 if train else 1)
    images = ds.data.unsqueeze(1).float().div_(255)
    return ImageDataset(images, ds.targets.long(), DIGIT_CLASSES, "torchvision.MNIST")


def load_cifar10(root="data", train: bool = True, download: bool = True, fallback_size: int | None = None) -> ImageDataset:
    """Real CIFAR-10 through torchvision if present or downloadable, else synthetic shapes (with one sentence why)."""
    try:
        ds = _load_torchvision("CIFAR10", root, train, download)
    except Exception as exc:
        n = fallback_size or (50_000 if train else 10_000)
        print(_("CIFAR-10 is not available under {root} ({error}: {message}); using {n} synthetic CIFAR-shaped "
                "images instead.").format(root=root, error=type(exc).__name__, message=message_line(exc)[:120], n=n))
        return synthetic_cifar(n, seed=0 if train else 1)
    images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).float().div_(255).contiguous()
    return ImageDataset(images, torch.tensor(ds.targets, dtype=torch.long), list(ds.classes), "torchvision.CIFAR10")


# --- per-sample augmentation (for DataLoader workers) ---------------------------------------

class AugmentedImages(Dataset):
    """Images with a per-sample augmentation in `__getitem__`: random crop of the zero-padded image,
    random horizontal flip, a little noise. This is the per-sample CPU work that DataLoader worker
    processes exist for. It lives in a module (not a notebook) so that worker processes started with
    "spawn" (macOS, Windows) can import it.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, pad: int = 4, noise: float = 0.02):
        if len(images) != len(labels):
            raise ValueError(_("{images} images but {labels} labels").format(images=len(images), labels=len(labels)))
        self.images, self.labels, self.pad, self.noise = images, labels, pad, noise

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = self.images[i]
        h, w = x.shape[-2:]
        padded = F.pad(x, (self.pad,) * 4)
        dy, dx = torch.randint(0, 2 * self.pad + 1, (2,)).tolist()
        x = padded[:, dy:dy + h, dx:dx + w]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        x = (x + self.noise * torch.randn_like(x)).clamp_(0, 1)
        return x, self.labels[i]


# --- a loader for in-memory tensors -------------------------------------------------------

class TensorLoader:
    """Serve (images, labels) batches straight from tensors, reshuffled every epoch.

    The fast alternative to DataLoader when the data fits in (GPU) memory: the tensors are moved to
    `device` once, shuffling is one randperm on that device, and each batch is an index_select. No
    worker processes, no per-sample Python, no host-to-device copy per step.

    `shard(rank, world_size)` gives one rank of a data-parallel run its share: every rank draws the same
    permutation (same seed) and takes every world_size-th sample of it (padded at the end by wrapping around,
    as DistributedSampler does, so all ranks get as many batches). `batch_size` is then per rank.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 64, shuffle: bool = True,
                 device=None, drop_last: bool = False, seed: int = 0):
        if len(images) != len(labels):
            raise ValueError(_("{images} images but {labels} labels").format(images=len(images), labels=len(labels)))
        if batch_size < 1:
            raise ValueError(_("batch_size must be at least 1, got {batch_size}").format(batch_size=batch_size))
        self.device = torch.device(device) if device is not None else images.device
        self.images = images.to(self.device)
        self.labels = labels.to(self.device)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self._epoch_start: torch.Tensor | None = None  # generator state the current epoch's order came from
        self._yielded = 0                             # batches of the current epoch handed out so far
        self._skip = 0                                # batches to leave out of the next epoch (a resume)
        self.rank, self.world_size = 0, 1

    def shard(self, rank: int, world_size: int) -> "TensorLoader":
        """This loader for rank `rank` of `world_size` (the same tensors, the same shuffling state)."""
        if not 0 <= rank < world_size:
            raise ValueError(_("rank must be in [0, {world_size}), got {rank}").format(world_size=world_size, rank=rank))
        shard = copy.copy(self)
        shard.generator = torch.Generator(device="cpu")
        shard.generator.set_state(self.generator.get_state())
        shard.rank, shard.world_size = rank, world_size
        return shard

    def _samples(self) -> int:
        return math.ceil(len(self.labels) / self.world_size)

    @classmethod
    def from_dataset(cls, dataset: ImageDataset, **kwargs) -> "TensorLoader":
        return cls(dataset.images, dataset.labels, **kwargs)

    def __len__(self) -> int:
        n = self._samples()
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self):
        n = len(self.labels)
        self._epoch_start = self.generator.get_state()
        if self.shuffle:
            # permutation drawn on the CPU generator (reproducible on every device), copied once per epoch
            order = torch.randperm(n, generator=self.generator)
        else:
            order = None if self.world_size == 1 else torch.arange(n)
        if self.world_size > 1:  # this rank's share: every world_size-th sample, padded by wrapping around
            pad = self._samples() * self.world_size - n
            order = torch.cat([order, order[:pad]])[self.rank::self.world_size]
        if order is not None:
            order = order.to(self.device, non_blocking=True)
        start, self._skip = self._skip, 0
        self._yielded = start
        for i in range(start, len(self)):
            if order is None:
                sl = slice(i * self.batch_size, (i + 1) * self.batch_size)
                batch = self.images[sl], self.labels[sl]
            else:
                idx = order[i * self.batch_size:(i + 1) * self.batch_size]
                batch = self.images.index_select(0, idx), self.labels.index_select(0, idx)
            self._yielded = i + 1
            yield batch
        self._epoch_start = None

    def state_dict(self) -> dict:
        """The shuffling state and, inside an epoch, how many of its batches were handed out, so an
        interrupted run resumes with the same batches (the torchdata "Stateful" protocol)."""
        if self._epoch_start is not None:  # inside an epoch, also after its last batch until the pass ends
            return {"generator": self._epoch_start, "batches_done": self._yielded}
        return {"generator": self.generator.get_state(), "batches_done": 0}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`; a mid-epoch state makes the next pass continue that epoch."""
        self.generator.set_state(state["generator"].to("cpu", torch.uint8))
        self._skip = int(state.get("batches_done", 0))
        self._epoch_start = None
