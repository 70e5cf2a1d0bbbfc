"""Vision models in torchvision's shapes: a ResNet with BatchNorm and a small ViT.

torchvision does not install beside the CPU build of torch this project pins (its
PyPI wheels need their own torch build), so these follow torchvision's
``resnet.BasicBlock`` and ``vision_transformer.EncoderBlock`` layer by layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.conformance.rows import BATCH_NORM_IN_BF16, Batch, Row, register

CLASSES = 5


class BasicBlock(nn.Module):
    """torchvision's ``resnet.BasicBlock``: two 3x3 convolutions with BatchNorm, a shortcut."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = (
            nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )
            if stride != 1 or inplanes != planes
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """A two-stage ResNet of BasicBlocks (BatchNorm in training mode: statistics per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, stride=2), BasicBlock(16, 16))
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class EncoderBlock(nn.Module):
    """torchvision's ``vision_transformer.EncoderBlock``: pre-norm attention and MLP."""

    def __init__(self, width: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.self_attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp), nn.GELU(), nn.Linear(mlp, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        x = x + self.self_attention(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class ViT(nn.Module):
    """A small ViT: patches by convolution, a class token, learned positions, encoder blocks."""

    def __init__(self, width: int = 16, layers: int = 2, patch: int = 4, image: int = 8) -> None:
        super().__init__()
        self.conv_proj = nn.Conv2d(3, width, patch, patch)
        tokens = (image // patch) ** 2 + 1
        self.class_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embedding = nn.Parameter(torch.randn(1, tokens, width) * 0.02)
        self.layers = nn.ModuleList(EncoderBlock(width, 2, 2 * width) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embedding
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x[:, 0]))


def _images(seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(4, 3, 8, 8, generator=gen),), {
        "labels": torch.randint(0, CLASSES, (4,), generator=gen)
    }


def _cross_entropy(out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    logits = out.to(torch.promote_types(out.dtype, torch.float32))
    return F.cross_entropy(logits, kwargs["labels"])


def _resnet() -> nn.Module:
    return _IgnoringLabels(ResNet())


def _vit() -> nn.Module:
    return _IgnoringLabels(ViT())


class _IgnoringLabels(nn.Module):
    """``forward(x, labels)`` of a classifier that ignores ``labels`` (the loss uses them)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(x)


register(
    Row(
        "vision/ResNet",
        _resnet,
        (BasicBlock,),
        _images,
        _cross_entropy,
        "BasicBlocks with BatchNorm2d in training (statistics per rank)",
        bf16_error=BATCH_NORM_IN_BF16,
    ),
    Row(
        "vision/ViT",
        _vit,
        (EncoderBlock,),
        _images,
        _cross_entropy,
        "patch convolution, class token, MultiheadAttention",
    ),
)
