"""Build the tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata, as llama.cpp does.

- `tokenizer.ggml.model = "gpt2"`: byte-level BPE from `tokens` + `merges`, text split first by
  the regexes llama.cpp's `llama-vocab.cpp` assigns to `tokenizer.ggml.pre` (applied one after
  another, each match and each gap becoming its own piece).
- `tokenizer.ggml.model = "llama"`: SentencePiece-style BPE over `▁`-escaped text with byte
  fallback (`<0x0A>`); merges from the file, else from `scores` (higher score merges first).

Control tokens (token_type 3) become special added tokens and user-defined ones (4) plain added
tokens, so both are matched whole in the text. BOS/EOS are added as `add_bos_token` /
`add_eos_token` say, with llama.cpp's defaults when the file is silent.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from localmoe.errors import TokenizerError
from localmoe.tokenizer.base import Tokenizer, bos_eos_processor

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # tokenizer.ggml.token_type

# Split regexes, in the tokenizer.json spelling (the HF `tokenizers` regex engine supports (?i:...)).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
              (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
               r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"))


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp pre-splits text for one `tokenizer.ggml.pre` value."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself a token is taken whole
    add_bos: bool = False        # llama.cpp's default when the file has no add_bos_token
    has_bos: bool = True         # False: llama.cpp ignores bos_token_id


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2_PRE = PreTokenizer((_GPT2,))
# SmolLM/StarCoder-style vocabularies were trained with every digit on its own (HF Digits(individual_digits=True)).
_DIGITS_THEN_GPT2 = PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)


def _names(pre: PreTokenizer, *names: str) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names, pre)


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    **_names(_GPT2_PRE, "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
             "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling",
             "exaone4", "jina-v1-en", "jina-v2-code", "roberta-bpe"),
    **_names(_DIGITS_THEN_GPT2, "starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
    **_names(_LLAMA3_PRE, "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
             "lfm2", "jina-v5-nano"),
    **_names(PreTokenizer((_LLAMA3,)), "dbrx", "smaug-bpe"),
    **_names(PreTokenizer((_LLAMA3,), has_bos=False), "glm4", "chatglm-bpe"),
    **_names(PreTokenizer((_QWEN2,)), "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2",
             "hunyuan"),
    "qwen35": PreTokenizer((_QWEN35,)),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    **_names(PreTokenizer((_GPT4O,)), "gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
    **_names(PreTokenizer(_DEEPSEEK3), "deepseek-v3", "hunyuan-dense"),
}


def tokenizer_from_gguf(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer embedded in the GGUF file at `path` (CheckpointError if the file is unreadable)."""
    from localmoe.store.gguf_split import open_gguf  # the header parser; imported here as it pulls in torch

    with open_gguf(path) as f:
        return tokenizer_from_gguf_metadata(f.metadata, source=os.path.basename(path))


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any], source: str) -> Tokenizer:
    """The tokenizer described by a GGUF metadata dict (key -> value); `source` names the file in messages."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise TokenizerError(f"{source} has no embedded tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens "
                             f"missing); use a GGUF converted with its tokenizer, or a directory with tokenizer.json")
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(token_types) != len(tokens):
        raise TokenizerError(f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries for "
                             f"{len(tokens)} tokens; the file is corrupt, convert the model again")

    def token_id(key: str, default: int | None = None) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}", default)
        if value is not None and not 0 <= int(value) < len(tokens):
            raise TokenizerError(f"{source}: tokenizer.ggml.{key} = {value} is outside the {len(tokens)}-token "
                                 f"vocabulary; the file is corrupt, convert the model again")
        return None if value is None else int(value)

    if kind == "gpt2":
        pre = _pre_tokenizer(metadata, source)
        backend = _byte_level_bpe(metadata, tokens, pre, source)
        bos = token_id("bos_token_id") if pre.has_bos else None
        eos, unk, add_bos = token_id("eos_token_id"), token_id("unknown_token_id"), pre.add_bos
    elif kind == "llama":
        # llama.cpp's defaults for a SentencePiece vocabulary: <unk>=0, <s>=1, </s>=2, BOS added.
        bos, eos, unk = token_id("bos_token_id", 1), token_id("eos_token_id", 2), token_id("unknown_token_id", 0)
        backend = _sentencepiece_bpe(metadata, tokens, token_types, unk, source)
        add_bos = True
    else:
        raise TokenizerError(f"{source}: tokenizer.ggml.model = {kind!r} is not supported (supported: 'gpt2' "
                             f"byte-level BPE, 'llama' SentencePiece BPE); use the model's tokenizer.json instead")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None

    backend.add_special_tokens([AddedToken(text, special=True, normalized=False)
                                for text, t in zip(tokens, token_types) if t == CONTROL])
    backend.add_tokens([AddedToken(text, special=False, normalized=False)
                        for text, t in zip(tokens, token_types) if t == USER_DEFINED])
    backend.post_processor = bos_eos_processor((tokens[bos], bos) if add_bos else None,
                                               (tokens[eos], eos) if add_eos else None)
    extra_stops = [i for i in (token_id("eot_token_id"), token_id("eom_token_id")) if i is not None]
    return Tokenizer(backend, source=source, bos_token_id=bos, eos_token_id=eos,
                     pad_token_id=token_id("padding_token_id"), unk_token_id=unk, extra_stop_ids=extra_stops,
                     chat_template=metadata.get("tokenizer.chat_template"))


def _pre_tokenizer(metadata: Mapping[str, Any], source: str) -> PreTokenizer:
    name = metadata.get("tokenizer.ggml.pre") or "default"  # llama.cpp: missing -> 'default', with a warning
    if name not in PRE_TOKENIZERS:
        raise TokenizerError(f"{source}: tokenizer.ggml.pre = {name!r} is not a pre-tokenizer localmoe knows "
                             f"(known: {', '.join(sorted(PRE_TOKENIZERS))}); use the model's tokenizer.json instead")
    return PRE_TOKENIZERS[name]


def _merges(metadata: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or ()]


def _vocab(tokens: list[str]) -> dict[str, int]:
    return {token: i for i, token in enumerate(tokens)}


def _bpe(source: str, **options: Any) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer(models.BPE(**options))
    except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception
        raise TokenizerError(f"{source}: tokenizer.ggml.merges does not fit tokenizer.ggml.tokens ({e}); "
                             f"the file is corrupt, convert the model again") from None


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str], pre: PreTokenizer,
                    source: str) -> tokenizers.Tokenizer:
    merges = _merges(metadata)
    if not merges:
        raise TokenizerError(f"{source}: a 'gpt2' tokenizer needs tokenizer.ggml.merges and the file has none; "
                             f"convert the model again")
    backend = _bpe(source, vocab=_vocab(tokens), merges=merges, ignore_merges=pre.ignore_merges)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(metadata: Mapping[str, Any], tokens: list[str], token_types: list[int],
                       unk: int | None, source: str) -> tokenizers.Tokenizer:
    vocab = _vocab(tokens)
    merges = _merges(metadata)
    if not merges:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None:
            raise TokenizerError(f"{source}: a 'llama' tokenizer needs tokenizer.ggml.scores or "
                                 f"tokenizer.ggml.merges and the file has neither; convert the model again")
        merges = _merges_from_scores(vocab, token_types, scores)
    backend = _bpe(source, vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True,
                   unk_token=tokens[unk] if unk is not None else None)
    escape = normalizers.Replace(" ", "\u2581")
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    # llama.cpp prefixes a space to the text (and after each special token), and drops it again when decoding.
    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), escape])
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        backend.normalizer = escape
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(vocab: dict[str, int], token_types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a normal token into two tokens, best-scored result first (SentencePiece's merge order)."""
    pieces = {t for t, i in vocab.items() if token_types[i] in (NORMAL, USER_DEFINED)}
    ranked = []
    for token in pieces:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in pieces and right in pieces:
                ranked.append((-scores[vocab[token]], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]

