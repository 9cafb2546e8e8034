"""Models for ``mpsync train``: a small CNN for image inputs, an MLP for flat features, and a
wide MLP whose gradients are large enough that a network link, not the CPU, sets the pace of
aggregation (the cross-node comparison)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from mpsync.apps.model_names import MODELS

__all__ = ["build_model", "SmallCNN", "MLP", "WideMLP", "ResNet", "MODELS"]


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


class WideMLP(nn.Module):
    """Flattened inputs through ``depth`` hidden layers of ``width`` units.

    With the defaults on 8x8 digits: 2.18 M parameters, 8.7 MB of float32 gradients per step,
    about 100x the digits CNN's, in 4 Linear layers of very different sizes (OSP ranks layers
    by importance, so it has both large and small ones to choose from).  A ring allreduce of
    8.7 MB over 4 workers moves 2 * 3/4 * 8.7 MB per worker: about 105 ms on 1 Gbit/s links,
    the order of one emulated iteration (50 ms) plus the forward and backward on a shared
    core, so at that rate communication is as long as computation.  The digits CNN's 80 KB
    would take 1 ms: no link a VM can emulate makes it matter.

    ``big-mlp`` is ``width=2048, depth=4``: 12.7 M parameters, 51 MB of float32 gradients on
    8x8 digits, in layers of 17 MB each, so that 25 MB buckets cut it in three; its backward
    on one core and its allreduce over a 1 Gbit/s link both take a few hundred milliseconds
    at batches of a few hundred, which is what overlapping the two needs to show
    (``bench/overlap``).
    """

    def __init__(self, features: int, n_classes: int, width: int = 1024, depth: int = 3):
        super().__init__()
        dims = [features] + [width] * depth
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.out = nn.Linear(width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.hidden:
            x = torch.relu(layer(x))
        return self.out(x)


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1 projection) shortcut:
    ResNet's basic block (He et al., CVPR 2016, §3.3, Fig. 2)."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.project = None
        if stride != 1 or c_in != c_out:
            self.project = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                         nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.project is None else self.project(x)))


class ResNet(nn.Module):
    """A ResNet-style CNN for [C,H,W] images: a 3x3 stem, three stages of two basic blocks at
    ``width``, 2x and 4x channels (stride 2 between stages, as CIFAR ResNets), global average
    pooling, one linear layer.  With ``width=64`` on 3x32x32 inputs: 2.8 M parameters (11 MB
    of float32 gradients) and about 0.5 G multiply-adds per sample forward, so at a batch of 64 a GPU,
    not the framework, sets the pace (``make gpu-check``'s model).  ``width`` 4-8 makes a
    model small enough for CPU tests."""

    def __init__(self, in_channels: int, n_classes: int, width: int = 64, blocks: int = 2):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        layers, c = [], width
        for stage, c_out in enumerate((width, 2 * width, 4 * width)):
            for b in range(blocks):
                layers.append(_BasicBlock(c, c_out, 2 if stage and b == 0 else 1))
                c = c_out
        self.blocks = nn.Sequential(*layers)
        self.fc = nn.Linear(c, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(torch.relu(self.bn(self.stem(x))))
        return self.fc(x.mean(dim=(2, 3)))


def build_model(input_shape: tuple[int, ...], n_classes: int, seed: int,
                name: str = "auto") -> nn.Module:
    """Seeded so every worker starts from the same weights even before the broadcast.

    ``name``: ``auto`` (the CNN for [C,H,W] images, the MLP for [D] features), ``cnn``,
    ``mlp``, ``wide-mlp`` or ``big-mlp`` (any input, flattened), ``resnet`` (images).
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    torch.manual_seed(seed)
    if name == "wide-mlp":
        return WideMLP(int(np.prod(input_shape)), n_classes)
    if name == "big-mlp":
        return WideMLP(int(np.prod(input_shape)), n_classes, width=2048, depth=4)
    if name == "resnet":
        if len(input_shape) != 3:
            raise ValueError(f"model 'resnet' takes [C,H,W] images, the data has shape "
                             f"{input_shape}")
        return ResNet(input_shape[0], n_classes)
    if name == "mlp" and len(input_shape) != 1:
        raise ValueError(f"model 'mlp' takes [D] features, the data has shape {input_shape}; "
                         "use wide-mlp (flattens) or cnn")
    if name == "cnn" and len(input_shape) != 3:
        raise ValueError(f"model 'cnn' takes [C,H,W] images, the data has shape {input_shape}")
    if len(input_shape) == 3:
        return SmallCNN(input_shape[0], input_shape[1], input_shape[2], n_classes)
    if len(input_shape) == 1:
        return MLP(input_shape[0], n_classes)
    raise ValueError(f"inputs of shape {input_shape}: expected [C,H,W] images or [D] features")
