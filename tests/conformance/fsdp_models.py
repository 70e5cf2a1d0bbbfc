"""PyTorch's own FSDP test models (``torch.testing._internal``), as FSDP2's tests wrap them.

Units follow FSDP2's tests: each ``fully_shard``-ed submodule is a unit (a
nested one, which funcshard's units cannot be, joins its parent). Models that
draw per-rank parameters in PyTorch's tests (``MixtureOfExperts``' experts) are
built as rank 0 builds them on every rank, since data-parallel ranks start equal.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from tests.conformance.rows import (
    BATCH_NORM_IN_BF16,
    Row,
    features,
    mean_square,
    register,
    sum_of,
    tokens,
    wide,
)


def _fsdp() -> Any:
    from torch.testing._internal import common_fsdp

    return common_fsdp


def _dtensor() -> Any:
    from torch.testing._internal.distributed._tensor import common_dtensor

    return common_dtensor


def mlp() -> nn.Module:
    return _fsdp().MLP(8, with_buffer=True)


def mlp_stack() -> nn.Module:
    return _fsdp().MLPStack(8)


def double_linear(second: bool) -> Any:
    return lambda: _fsdp().DoubleLinear(8, use_second_linear=second)


def nested_wrapped() -> nn.Module:
    f = _fsdp()
    return f.NestedWrappedModule(
        f.DummyProcessGroup(0, 1),
        wrap_fsdp=False,
        device_init_mode=f.DEVICEInitMode.DEVICE_BEFORE,
        deterministic=True,
    )


def mixture_of_experts() -> nn.Module:
    f = _fsdp()
    return f.MixtureOfExperts(
        f.DummyProcessGroup(0, 1),
        wrap_fsdp=False,
        device_init_mode=f.DEVICEInitMode.DEVICE_BEFORE,
        delay_before_free_ms=0,
        deterministic=True,
    )


def shared_params_transformer() -> nn.Module:
    """``TransformerWithSharedParams`` (embedding tied to the output, a BatchNorm), as FSDP tests make it.

    ``deterministic=True`` puts it in eval mode (no dropout), as PyTorch's tests do.
    """
    f = _fsdp()
    with warnings.catch_warnings():  # its nn.Transformer is not batch_first: no nested tensors
        warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
        return f.TransformerWithSharedParams(
            f.DummyProcessGroup(0, 1),
            device_init_mode=f.DEVICEInitMode.DEVICE_BEFORE,
            add_bn=True,
            deterministic=True,
        )


def _seq2seq(seed: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 23, (6, 2), generator=gen),
        torch.randint(0, 23, (4, 2), generator=gen),
    ), {}


def _cross_entropy_sum(out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    tgt = args[1]  # TransformerWithSharedParams.get_loss
    return nn.functional.cross_entropy(
        wide(out).view(-1, out.size(-1)), tgt.view(-1), reduction="sum"
    )


def transformer(*, checkpoint: bool = False, tied: bool = True) -> Any:
    def build() -> nn.Module:
        d = _dtensor()
        args = d.ModelArgs(
            n_layers=2,
            vocab_size=8,
            max_seq_len=16,
            dim=16,
            n_heads=4,
            dropout_p=0.0,
            weight_tying=tied,
            checkpoint_activations=checkpoint,
        )
        return d.Transformer(args)

    return build


def _block() -> Any:
    return _dtensor().TransformerBlock


register(
    Row(
        "fsdp/MLP", mlp, (nn.Linear,), features(4, 8), mean_square, "two Linear units and a buffer"
    ),
    Row("fsdp/MLPStack", mlp_stack, ("MLP",), features(4, 8), mean_square, "uneven dims (3x)"),
    Row(
        "fsdp/DoubleLinear",
        double_linear(True),
        (nn.Linear,),
        features(4, 8),
        sum_of,
        "a unit's module returning two outputs",
    ),
    Row(
        "fsdp/DoubleLinear-unused",
        double_linear(False),
        (nn.Linear,),
        features(4, 8),
        sum_of,
        "an unused unit (zero gradients)",
    ),
    Row(
        "fsdp/NestedWrappedModule",
        nested_wrapped,
        ("module/1", "module/2"),
        features(4, 8),
        sum_of,
        "units by path, a Sequential unit",
    ),
    Row(
        "fsdp/MixtureOfExperts",
        mixture_of_experts,
        ("module/1", "module/2"),
        features(4, 8),
        sum_of,
        "shared and expert Linear units",
    ),
    Row(
        "fsdp/TransformerWithSharedParams",
        shared_params_transformer,
        (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer),
        _seq2seq,
        _cross_entropy_sum,
        "nn.Transformer layers, tied embedding and output, BatchNorm in eval",
        bf16_error=BATCH_NORM_IN_BF16,
    ),
    Row(
        "dtensor/Transformer",
        transformer(),
        ("TransformerBlock",),
        tokens(8, (2, 8)),
        mean_square,
        "weight tying",
    ),
    Row(
        "dtensor/Transformer-untied",
        transformer(tied=False),
        ("TransformerBlock",),
        tokens(8, (2, 8)),
        mean_square,
        "no weight tying",
    ),
    Row(
        "dtensor/Transformer-checkpointed",
        transformer(checkpoint=True),
        ("TransformerBlock",),
        tokens(8, (2, 8)),
        mean_square,
        "torch.utils.checkpoint.checkpoint(layer, use_reentrant=False) in its forward",
    ),
)
