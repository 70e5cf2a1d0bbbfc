"""The tiny Hugging Face configs the interop tests build models from (nothing is downloaded)."""

from __future__ import annotations

from typing import Any


def tiny_llama_config(
    *, vocab: int = 64, layers: int = 2, positions: int = 8, tied: bool = True
) -> Any:
    """A ``LlamaConfig`` of hidden size 32 (MLP 64), 4 heads and 2 key-value heads."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        tie_word_embeddings=tied,
    )
