"""Tokenizers: from GGUF metadata or a Hugging Face directory, with chat templates and streaming decode."""

from localmoe.tokenizer.base import END_OF_TURN_TOKENS, StreamDecoder, Tokenizer, end_of_generation_ids
from localmoe.tokenizer.gguf import PRE_TOKENIZERS, tokenizer_from_gguf, tokenizer_from_gguf_metadata
from localmoe.tokenizer.hf import tokenizer_from_hf_dir

__all__ = [
    "END_OF_TURN_TOKENS", "PRE_TOKENIZERS", "StreamDecoder", "Tokenizer", "end_of_generation_ids",
    "tokenizer_from_gguf", "tokenizer_from_gguf_metadata", "tokenizer_from_hf_dir",
]
