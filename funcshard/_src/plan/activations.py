"""Activation memory of a transformer per rank, from its shape (Korthikanti et al. 2022), its logits and loss, and the workload they depend on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from funcshard._src.plan.model_config import ModelConfig
from funcshard._src.plan.precision import FULL_PRECISION, MixedPrecision


@dataclass(frozen=True)
class Workload:
    """What each rank computes per step: enough to estimate activations and FLOPs.

    Attributes:
        model: the model's shape (a preset's ``config``, or your own).
        batch_size: sequences per rank per step (the micro-batch).
        seq_len: tokens per sequence; default ``model.seq_len``.
        remat: recompute each unit's activations in backward (``fs.call(remat=True)``).
        flash_attention: attention that keeps no ``(s, s)`` score matrices
            (FlashAttention, ``scaled_dot_product_attention``'s fused kernels).
        logits: whether the logits and the loss over ``model.vocab`` are held whole
            (:func:`logits_bytes`); ``False`` for a fused or chunked cross-entropy
            that never materializes them.
    """

    model: ModelConfig
    batch_size: int = 1
    seq_len: int | None = None
    remat: bool = False
    flash_attention: bool = False
    logits: bool = True

    def __post_init__(self) -> None:
        if self.batch_size < 1 or (self.seq_len is not None and self.seq_len < 1):
            raise ValueError(
                f"Workload: batch_size and seq_len must be positive, got {self.batch_size}, {self.seq_len}"
            )

    @property
    def tokens(self) -> int:
        """Tokens per rank per step."""
        return self.batch_size * (self.seq_len or self.model.seq_len)


def activations_of(
    workload: Workload | None,
    mixed_precision: MixedPrecision | None,
    dtypes: Sequence[torch.dtype],
    /,
) -> int:
    """Bytes per rank that ``workload`` keeps besides the model state (0 without one):
    the layers' activations and the logits with the loss, :func:`activation_parts` added up."""
    return sum(activation_parts(workload, mixed_precision, dtypes))


def activation_parts(
    workload: Workload | None,
    mixed_precision: MixedPrecision | None,
    dtypes: Sequence[torch.dtype],
    /,
) -> tuple[int, int]:
    """``(layer activations, logits and loss)`` in bytes per rank for ``workload`` (0s without one).

    Both take the compute dtype of the params' first floating dtype in ``dtypes``
    (fp32 when there is none).
    """
    if workload is None:
        return 0, 0
    stored = next((d for d in dtypes if d.is_floating_point), torch.float32)
    compute = (mixed_precision or FULL_PRECISION).compute_dtype(stored)
    layers = activation_bytes(
        workload.model,
        batch=workload.batch_size,
        seq_len=workload.seq_len or workload.model.seq_len,
        dtype_bytes=compute.itemsize,
        remat=workload.remat,
        flash_attention=workload.flash_attention,
    )
    if not workload.logits:
        return layers, 0
    return layers, logits_bytes(workload.model, workload.tokens, dtype_bytes=compute.itemsize)


def logits_bytes(config: ModelConfig, /, tokens: int, *, dtype_bytes: int = 2) -> int:
    """Bytes of the logits and the loss at their peak: ``tokens * vocab * (dtype_bytes + 8)``.

    The output head writes ``tokens x vocab`` logits in the compute dtype
    (``dtype_bytes``); the loss upcasts them to fp32 and keeps an fp32 log-softmax
    for backward (4 bytes per logit alive at once), and backward makes their fp32
    gradient (4 more) before casting it back. With a vocabulary of 128,256 (Llama 3)
    and 8,192 tokens in bf16 that is 10.5 GB, more than many models' activations
    per layer stack. A fused or chunked cross-entropy holds far less:
    ``Workload(logits=False)``. An encoder-decoder's logits are over its decoder's
    tokens, as many as the encoder's here.

    Example:
        >>> from funcshard._src.plan.presets import get_preset
        >>> logits_bytes(get_preset("llama-7b").config, 2048) == 2048 * 32000 * (2 + 4 + 4)
        True
    """
    if min(tokens, dtype_bytes) < 1:
        raise ValueError(
            f"logits_bytes: tokens={tokens} and dtype_bytes={dtype_bytes} must be >= 1"
        )
    return tokens * config.vocab * (dtype_bytes + 8)


def activation_bytes(
    config: ModelConfig,
    /,
    batch: int,
    seq_len: int | None = None,
    *,
    dtype_bytes: int = 2,
    remat: bool = False,
    flash_attention: bool = False,
) -> int:
    """Bytes of activations one rank keeps for backward, over all transformer layers.

    Follows Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models" (arXiv:2205.05198), Sec. 4.1: with 16-bit activations,
    1-byte dropout masks and no tensor or sequence parallelism, one layer keeps
    ``s*b*h*(34 + 5*a*s/h)`` bytes (``s`` sequence, ``b`` micro-batch, ``h`` hidden,
    ``a`` heads): attention ``11sbh + 5as^2b``, MLP ``19sbh``, two norms ``4sbh``.
    For a ``gpt``-style config (``ffn_hidden = 4h``, ``n_heads * head_dim = h``,
    no GQA) and ``dtype_bytes=2`` the result is exactly ``n_layers`` times that.
    Otherwise each term uses the model's real widths, with ``p = dtype_bytes``:

    - attention: ``p*sb*(h + 2*attn_dim + 2*kv_dim) + 2p*a*s^2b`` (norm output, Q,
      K, V, projection input, softmax and its dropout) plus masks ``sbh + a*s^2b``;
    - MLP: ``p*sb*(h + 2F)`` plus mask ``sbh``; gated (SwiGLU) ``p*sb*(h + 4F)``
      (gate, its activation, up, product); a MoE layer (Mixtral) ``k`` times that for
      the ``k`` experts each token runs, plus its router logits ``p*sb*E``;
    - each norm keeps its input, ``p*sbh``.

    With full recomputation (``remat``) a layer keeps only its input, ``p*sbh``
    (``2sbh`` in the paper), and backward rebuilds one layer at a time, so the
    largest layer's full activations are added once.

    Encoder-decoder models (T5) use ``seq_len`` for both stacks. An encoder layer
    is counted like a decoder-only layer; a decoder layer adds cross-attention
    (the attention terms with keys and values over the encoder's ``seq_len``) and
    a third norm; the encoder output, read by every decoder layer, is added once.

    Not counted: embeddings, the final norm, temporary buffers; the logits and the
    loss (large for big vocabularies) are :func:`logits_bytes`. FlashAttention keeps no ``a*s^2`` terms; this does.

    Args:
        config: the model.
        batch: sequences per rank (the micro-batch).
        seq_len: tokens per sequence; ``config.seq_len`` when ``None``.
        dtype_bytes: bytes per activation element (2 for bf16/fp16, 4 for fp32).
        remat: whether every layer is recomputed in backward (activation checkpointing).
        flash_attention: attention keeps no ``(s, s)`` scores, softmax or dropout mask
            (they are recomputed in backward), only the softmax's fp32 log-sum-exp,
            ``4*a*s*b`` bytes: the ``5*a*s/h`` term becomes ``4*a/h``.

    Returns:
        The estimate, in bytes.

    Raises:
        ValueError: a batch, sequence length or dtype size below 1.

    Example:
        >>> from funcshard._src.plan.presets import get_preset
        >>> cfg = get_preset("gpt-175b").config  # s*b*h*(34 + 5*a*s/h) per layer
        >>> activation_bytes(cfg, 1) == 96 * 2048 * 12288 * (34 + 5 * 96 * 2048 // 12288)
        True
        >>> activation_bytes(cfg, 1, remat=True) == 96 * 2 * 2048 * 12288 + 2048 * 12288 * 114
        True
        >>> activation_bytes(cfg, 1, flash_attention=True) == 96 * 2048 * (12288 * 34 + 4 * 96)
        True
    """
    s = config.seq_len if seq_len is None else seq_len
    if min(batch, s, dtype_bytes) < 1:
        raise ValueError(
            f"activation_bytes: batch={batch}, seq_len={s} and dtype_bytes={dtype_bytes} "
            f"must be >= 1"
        )
    p, h, tokens = dtype_bytes, config.hidden, batch * s
    scores = config.n_heads * batch * s * s  # one (s, s) matrix per head and sequence
    width = h + 2 * config.attn_dim + 2 * config.kv_dim  # norm output, Q, K, V, projection input
    if flash_attention:  # scores recomputed in backward; only the fp32 log-sum-exp is kept
        attn = p * tokens * width + tokens * h + 4 * config.n_heads * tokens
    else:
        attn = p * (tokens * width + 2 * scores) + (tokens * h + scores)  # + dropout masks
    routed = max(1, config.experts_per_token)  # a MoE layer runs each token through k experts
    mlp = p * tokens * routed * (h + (4 if config.gated_mlp else 2) * config.ffn_hidden)
    mlp += tokens * h + p * tokens * config.n_experts  # + the mask; a MoE's router logits
    layer = attn + mlp + 2 * p * tokens * h  # + the inputs of two norms
    # An encoder-decoder keeps the encoder output for every decoder layer's cross-attention,
    # which costs a decoder layer one more attention block and norm.
    kept, cross = (p * tokens * h, attn + p * tokens * h) if config.encoder_decoder else (0, 0)
    if remat:
        return config.n_layers * p * tokens * h + layer + cross + kept
    return config.n_encoder_layers * layer + config.n_decoder_layers * (layer + cross) + kept
