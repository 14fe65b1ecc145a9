"""The two small networks the course trains.

Both are plain `nn.Module`s with a `features` block (convolutions) and a `classifier` block
(linear layers), so notebooks can point at each part.
"""
from __future__ import annotations

import torch
from torch import nn


class SimpleCNN(nn.Module):
    """MNIST-shaped classifier: 1x28x28 -> 10 logits. 2 conv + 2 linear layers, about 420k parameters.

    conv 3x3 (1->32) + ReLU + 2x2 max-pool -> 32x14x14
    conv 3x3 (32->64) + ReLU + 2x2 max-pool -> 64x7x7
    flatten -> linear 3136->128 + ReLU -> linear 128->10
    """

    def __init__(self, num_classes: int = 10, hidden: int = 128):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * 7 * 7, hidden), nn.ReLU(), nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class CifarCNN(nn.Module):
    """CIFAR-shaped classifier: 3x32x32 -> 10 logits. 3 conv + 2 linear layers, about 620k parameters.

    Three blocks of conv 3x3 + ReLU + 2x2 max-pool (3->32->64->128 channels, 32->16->8->4 pixels),
    then flatten -> linear 2048->256 + ReLU -> linear 256->10.
    """

    def __init__(self, num_classes: int = 10, hidden: int = 256):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(128 * 4 * 4, hidden), nn.ReLU(), nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements (shared parameters counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
