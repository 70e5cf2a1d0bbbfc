"""Hugging Face families, built from tiny configs (nothing is downloaded), with their own losses.

Dropout is off (data-parallel ranks would draw apart from the reference's), and
token ids fit the tiny vocabularies. Units are each family's decoder or encoder
layer class, as FSDP users wrap them.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.conformance.rows import Batch, Row, register

VOCAB, SEQ, BATCH = 32, 6, 2


def _transformers() -> Any:
    import transformers

    return transformers


def _llama(checkpointing: bool = False) -> Any:
    def build() -> Any:
        t = _transformers()
        config = t.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=0,
        )
        model = t.LlamaForCausalLM(config)
        if checkpointing:  # the newer name of gradient_checkpointing_enable
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        return model

    return build


def _gpt2() -> Any:
    t = _transformers()
    config = t.GPT2Config(
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=SEQ,
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return t.GPT2LMHeadModel(config)


def _t5() -> Any:
    t = _transformers()
    config = t.T5Config(
        d_model=16,
        d_ff=32,
        d_kv=8,
        num_heads=2,
        num_layers=2,
        num_decoder_layers=2,
        vocab_size=VOCAB,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return t.T5ForConditionalGeneration(config)


def _bert() -> Any:
    t = _transformers()
    config = t.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    return t.BertForMaskedLM(config)


def _bert_checkpointed() -> Any:
    """BERT with gradient checkpointing: the flag on BertModel, its layers a level down."""
    model = _bert()  # the newer name of gradient_checkpointing_enable, as for Llama
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    return model


def _ids(seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=gen)
    return (), {"input_ids": ids, "labels": ids}


def _seq2seq(seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(2, VOCAB, (BATCH, SEQ), generator=gen)
    return (), {
        "input_ids": src,
        "labels": torch.randint(2, VOCAB, (BATCH, SEQ - 1), generator=gen),
    }


def _model_loss(out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return out.loss


def _row(
    name: str, build: Any, units: tuple[Any, ...], batch: Any, construct: str, **kw: Any
) -> Row:
    return Row(name, build, units, batch, _model_loss, construct, **kw)


register(
    _row("hf/Llama", _llama(), ("LlamaDecoderLayer",), _ids, "tied embeddings, rotary buffers"),
    _row(
        "hf/Llama-gradient-checkpointing",
        _llama(checkpointing=True),
        ("LlamaDecoderLayer",),
        _ids,
        "model.gradient_checkpointing_enable() (translated into remat)",
    ),
    _row("hf/GPT2", _gpt2, ("GPT2Block",), _ids, "Conv1D layers, tied head"),
    _row("hf/T5", _t5, ("T5Block",), _seq2seq, "encoder-decoder, relative position bias"),
    _row("hf/BERT", _bert, ("BertLayer",), _ids, "masked LM, tied decoder, pooler unused"),
    _row(
        "hf/BERT-gradient-checkpointing",
        _bert_checkpointed,
        ("BertLayer",),
        _ids,
        "gradient_checkpointing_enable() on a model whose layers sit a level down (encoder.layer)",
    ),
)
