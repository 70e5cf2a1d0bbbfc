"""The shapes of a transformer: what presets build parameters from and activations are estimated from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, TypeAlias

Arch: TypeAlias = Literal["llama", "bloom", "gpt_neox", "gpt", "t5"]
ARCHS: tuple[Arch, ...] = ("llama", "bloom", "gpt_neox", "gpt", "t5")


@dataclass(frozen=True)
class ModelConfig:
    """The shapes of a transformer: enough to rebuild its parameters and estimate its activations.

    ``arch`` fixes the layout: ``llama`` (RMSNorm, rotary, SwiGLU, untied head),
    ``bloom`` (LayerNorm with biases, ALiBi, fused QKV with bias, embedding norm,
    tied head), ``gpt_neox`` (LayerNorm, rotary, fused QKV, untied head), ``gpt``
    (GPT-2/3: learned positions of ``seq_len`` rows, LayerNorm, fused QKV, tied
    head) and ``t5`` (v1.0: RMSNorm without bias, relative attention bias, ReLU
    MLP, no biases, tied head, encoder and decoder).

    Attributes:
        arch: the parameter layout, one of :data:`ARCHS`.
        n_layers: transformer blocks in all, encoder and decoder together.
        hidden: model width ``h``.
        ffn_hidden: inner width of the MLP.
        n_heads: attention heads ``a``.
        n_kv_heads: key/value heads; fewer than ``n_heads`` with grouped-query attention.
        head_dim: width of one head; ``n_heads * head_dim`` need not be ``hidden`` (T5).
        vocab: vocabulary size.
        seq_len: the sequence length the model was trained with; the default of
            :func:`activation_bytes`.
        n_encoder_layers: encoder blocks of an encoder-decoder model; 0 for decoder-only.
        n_experts: experts in each MoE MLP (Mixtral: 8); 0 for a dense MLP. ``llama`` only:
            a router ``(hidden, n_experts)`` and each expert a SwiGLU MLP of ``ffn_hidden``.
        experts_per_token: experts each token is routed to (Mixtral: 2); 0 when dense.
        qkv_bias: whether the query, key and value projections have biases (Qwen2);
            ``llama`` only.

    Example:
        >>> cfg = ModelConfig("llama", n_layers=2, hidden=8, ffn_hidden=16, n_heads=2,
        ...                   n_kv_heads=1, head_dim=4, vocab=10, seq_len=16)
        >>> cfg.attn_dim, cfg.kv_dim, cfg.encoder_decoder
        (8, 4, False)
    """

    arch: Arch
    n_layers: int
    hidden: int
    ffn_hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    seq_len: int
    n_encoder_layers: int = 0
    n_experts: int = 0
    experts_per_token: int = 0
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"ModelConfig.arch: unknown {self.arch!r}; choose one of {ARCHS}")
        if type(self.qkv_bias) is not bool:
            raise ValueError(f"ModelConfig.qkv_bias must be a bool, got {self.qkv_bias!r}")
        for field in dataclasses.fields(self)[1:]:
            if field.name == "qkv_bias":
                continue
            value: object = getattr(self, field.name)
            low = 0 if field.name in ("n_encoder_layers", "n_experts", "experts_per_token") else 1
            if type(value) is not int or value < low:
                raise ValueError(f"ModelConfig.{field.name} must be an int >= {low}, got {value!r}")
        if not (
            0 < self.experts_per_token <= self.n_experts
            or self.experts_per_token == self.n_experts == 0
        ):
            raise ValueError(
                f"ModelConfig: n_experts={self.n_experts} with experts_per_token="
                f"{self.experts_per_token}; a MoE model routes each token to 1..n_experts "
                f"experts, a dense one has 0 of both"
            )
        if (self.n_experts or self.qkv_bias) and self.arch != "llama":
            raise ValueError(
                f"ModelConfig: arch={self.arch!r} with n_experts={self.n_experts}, qkv_bias="
                f"{self.qkv_bias}; experts and q/k/v biases are options of the llama layout"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig: n_heads={self.n_heads} is not a multiple of "
                f"n_kv_heads={self.n_kv_heads}; each key/value head serves a whole group"
            )
        if (self.arch == "t5") != (0 < self.n_encoder_layers < self.n_layers):
            raise ValueError(
                f"ModelConfig: arch={self.arch!r} with n_encoder_layers={self.n_encoder_layers} of "
                f"n_layers={self.n_layers}; only t5 has an encoder, and it has both stacks"
            )

    @property
    def encoder_decoder(self) -> bool:
        """Whether the model has an encoder and a decoder stack."""
        return self.n_encoder_layers > 0

    @property
    def n_decoder_layers(self) -> int:
        """Decoder blocks (all blocks of a decoder-only model)."""
        return self.n_layers - self.n_encoder_layers

    @property
    def attn_dim(self) -> int:
        """Width of the queries and of the attention output: ``n_heads * head_dim``."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the keys and of the values: ``n_kv_heads * head_dim``."""
        return self.n_kv_heads * self.head_dim

    @property
    def moe(self) -> bool:
        """Whether each MLP is a mixture of experts."""
        return self.n_experts > 0

    @property
    def gated_mlp(self) -> bool:
        """Whether the MLP is gated (SwiGLU: three matrices, four wide activations)."""
        return self.arch == "llama"

    @property
    def tied_embeddings(self) -> bool:
        """Whether the output head reuses ``embed/tokens`` (no ``head/w`` leaf)."""
        return self.arch in ("bloom", "gpt", "t5")
