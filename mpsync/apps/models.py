"""Models for ``mpsync train``: a small CNN for image inputs, an MLP for flat features."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["build_model", "SmallCNN", "MLP"]


class SmallCNN(nn.Module):
    """Two 3x3 convolutions and two linear layers (~20k parameters on 8x8 digits): small enough
    that 5 ranks fit on 2 cores, deep enough that OSP has several layers to rank."""

    def __init__(self, in_channels: int, height: int, width: int, n_classes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        flat = 32 * (height // 2) * (width // 2)
        self.fc1 = nn.Linear(flat, 64)
        self.fc2 = nn.Linear(64, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class MLP(nn.Module):
    def __init__(self, features: int, n_classes: int, hidden: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def build_model(input_shape: tuple[int, ...], n_classes: int, seed: int) -> nn.Module:
    """Seeded so every worker starts from the same weights even before the broadcast."""
    torch.manual_seed(seed)
    if len(input_shape) == 3:
        return SmallCNN(input_shape[0], input_shape[1], input_shape[2], n_classes)
    if len(input_shape) == 1:
        return MLP(input_shape[0], n_classes)
    raise ValueError(f"inputs of shape {input_shape}: expected [C,H,W] images or [D] features")
