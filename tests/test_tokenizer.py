"""The tokenizer against transformers and against the model's true pre-tokenizer.

References for the default model (SmolLM2-135M-Instruct GGUF, tokenizer.ggml.pre = "smollm"):

- `hf_gguf`: transformers' own GGUF tokenizer loader. It has no entry for "smollm" and falls
  back to GPT-2's ByteLevel regex, i.e. it does NOT isolate numeric characters first.
- `hf_true`: the same vocabulary and merges with the pre-tokenizer of SmolLM2's original
  tokenizer.json, Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)]. llama.cpp's
  "smollm" pre-tokenizer is the same thing (split \\p{N} one by one, then the GPT-2 regex), and
  so is ours. This is the reference we must equal everywhere.

The two references differ exactly where isolating numerics changes the GPT-2 split: a run of
whitespace right before a numeric character ("x  1": GPT-2 regex gives " ", " 1" -> Ġ Ġ 1;
isolated, "  " becomes the merged ĠĠ), and a space before a multi-byte numeric ("x ½": GPT-2
regex keeps " ½" together and merges Ġ with ½'s lead byte). Digits never merge with anything
in this vocabulary (it was trained with isolated digits), which is why plain numbers agree.
"""

import itertools
import unicodedata

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from localmoe.errors import CheckpointError, TokenizerError
from localmoe.store.gguf import GGUFFile
from localmoe.tokenizer import tokenizer_from_gguf, tokenizer_from_gguf_metadata
from localmoe.tokenizer.hf import tokenizer_from_hf_dir

CASES = [
    "", " ", "Hello world", "Hello, world! How are you?", "  leading spaces", "trailing spaces   ",
    "multiple    internal     spaces", "tabs\tand\t\ttabs", "line\nbreaks\n\nand\r\nwindows\r\n", "\n\n\n",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "Grüße aus München: Äpfel, Öl und Übermut — straße",
    "你好，世界！这是一个测试。", "日本語のテキストとカタカナ、ひらがな", "مرحبا بالعالم", "Привет, мир! Как дела?",
    "नमस्ते दुनिया", "한국어 텍스트입니다", "Ελληνικά γράμματα", "Café naïve résumé façade Ångström",
    "Emoji: 😀👍🏽 and ❤️", "family 👨‍👩‍👧‍👦 and 🏳️‍🌈", "flags 🇩🇪🇯🇵🇺🇸", "tag flag 🏴󠁧󠁢󠁳󠁣󠁴󠁿",
    "def foo(x):\n    return x ** 2  # square\n",
    "class A:\n\tdef __init__(self):\n\t\tself.a = [1, 2, 3]\n",
    '{"key": "value", "n": 12, "list": [1, 2.5, null], "nested": {"a": true}}',
    "#include <stdio.h>\nint main(void) {\n    printf(\"%d\\n\", 42);\n    return 0;\n}\n",
    "0", "7", "42", "123", "2024", "31415926535", "3.14159", "1,000,000", "-17e+3", "0x1F", "v1.2.3",
    "abc123def", "x  1", "a\n 1", "a\n\n1", "x\r\n1", "foo(  1, 2)", "    1", "x =  2", "  42  ",
    "x ½", " ² and m²", " Ⅻ", " ٣٤", "１２３", " १२३",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more", "<|im_end|>",
    "<|im_start|> spaced <|im_end|>", "<repo_name>x<file_sep>y",
    "mixed 中文 and English 123 テスト", "\u00a0non-breaking\u00a0spaces", "zero\u200bwidth", "a\u30001",
]

# Strings where `hf_gguf` (no numeric isolation) is expected to differ from the true tokenizer.
DIGIT_ISOLATION_CASES = {
    "x  1", "a\n 1", "a\n\n1", "x\r\n1", "foo(  1, 2)", "    1", "x =  2", "  42  ", "x ½", " ² and m²",
    " Ⅻ", " ٣٤",
}

# Bytes that never occur in SmolLM2's vocabulary (it was trained on a restricted byte alphabet):
# control characters U+0004/06/13/14/16/1D and UTF-8 lead bytes F1/F2 (U+40000..U+BFFFF). Both
# llama.cpp and HF tokenizers drop such bytes, so text containing them cannot round-trip.
MISSING_CHARACTERS = "\x04\x06\x13\x14\x16\x1d"

slow = pytest.mark.slow  # needs transformers' own load of the GGUF (~15 s, once per module)


@pytest.fixture(scope="module")
def gguf_path(smollm2_gguf):
    return smollm2_gguf


@pytest.fixture(scope="module")
def ours(gguf_path):
    return tokenizer_from_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_gguf(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_true(hf_gguf):
    backend = tokenizers.Tokenizer.from_str(hf_gguf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return backend


def _isolated_numerics(text):
    """`text` cut before and after every numeric character (general category N*)."""
    pieces, current = [], ""
    for ch in text:
        if unicodedata.category(ch).startswith("N"):
            pieces += [current, ch] if current else [ch]
            current = ""
        else:
            current += ch
    return pieces + [current] if current else pieces


def test_enough_cases():
    assert len(CASES) >= 50 and len(set(CASES)) == len(CASES)


@slow
@pytest.mark.parametrize("text", CASES)
def test_encode_equals_true_smollm_tokenizer(ours, hf_true, text):
    assert ours.encode(text) == hf_true.encode(text).ids


@slow
@pytest.mark.parametrize("text", CASES)
def test_encode_against_transformers_gguf_loader(ours, hf_gguf, text):
    expected = hf_gguf.encode(text)
    if text in DIGIT_ISOLATION_CASES:
        assert ours.encode(text) != expected
        # The whole difference is the numeric isolation: transformers agrees piece by piece.
        assert ours.encode(text) == [i for piece in _isolated_numerics(text) for i in hf_gguf.encode(piece)]
    else:
        assert ours.encode(text) == expected


@slow
@pytest.mark.parametrize("text", CASES)
def test_decode_equals_transformers(ours, hf_gguf, text):
    ids = ours.encode(text)
    assert ours.decode(ids) == hf_gguf.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == hf_gguf.decode(ids, skip_special_tokens=True)


@slow
def test_metadata_facts(ours, hf_gguf):
    assert ours.vocab_size == 49152 == len(hf_gguf)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert (ours.bos_token_id, ours.eos_token_id) == (hf_gguf.bos_token_id, hf_gguf.eos_token_id)
    assert ours.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                   "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>"}
    assert ours.chat_template == hf_gguf.chat_template
    assert ours.token_to_id("<|im_end|>") == 2 and ours.id_to_token(1) == "<|im_start|>"


@slow
def test_no_bos_for_smollm2(ours, hf_gguf):
    # The file says add_bos_token = False (and the template writes <|im_start|> itself): like
    # transformers and llama.cpp, nothing is prepended.
    assert not ours.add_bos_token
    assert ours.encode("Hello")[0] != ours.bos_token_id
    assert ours.encode("Hello") == hf_gguf.encode("Hello")


def test_stop_token_ids(ours):
    assert ours.token_to_id("<|im_end|>") in ours.stop_token_ids
    assert ours.stop_token_ids == {ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>")}


def test_special_tokens_in_text_are_whole(ours):
    assert ours.encode("<|im_start|>user") == [1, ours.encode("user")[0]]
    assert ours.decode(ours.encode("a<|im_end|>b"), skip_special_tokens=True) == "ab"


@slow
def test_missing_bytes_are_dropped_like_llama_cpp(ours, hf_true):
    # "\x04" is its own GPT-2 piece; its byte has no token, so it vanishes (llama.cpp skips it too).
    assert ours.encode("a\x04b") == ours.encode("a") + ours.encode("b") == hf_true.encode("a\x04b").ids


round_trip_text = st.text(st.characters(max_codepoint=0x3FFFF, exclude_characters=MISSING_CHARACTERS,
                                        exclude_categories=("Cs",)), max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=round_trip_text)
def test_round_trip(ours, text):
    assert ours.decode(ours.encode(text)) == text


STREAM_CASES = ["你好，世界！这是一个测试。", "family 👨‍👩‍👧‍👦 flags 🇩🇪🇯🇵 ok", "Grüße ½ ٣٤ नमस्ते",
                "<|im_start|>assistant\n日本語<|im_end|>"]


@pytest.mark.parametrize("text", STREAM_CASES)
@pytest.mark.parametrize("skip", [False, True], ids=["keep_special", "skip_special"])
def test_stream_decoder_matches_decode(ours, text, skip):
    ids = ours.encode(text)
    decoder = ours.stream_decoder(skip_special_tokens=skip)
    pieces = [decoder.feed(i) for i in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == ours.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in p for p in pieces)
    # Some token really does end mid-character here, so holding back was exercised.
    assert any("\ufffd" in ours.decode([i]) for i in ids)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=round_trip_text)
def test_stream_decoder_property(ours, text):
    ids = ours.encode(text)
    pieces = list(ours.stream_decoder()(ids))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces) or "\ufffd" in text


def test_stream_decoder_sends_each_character_once_complete(ours):
    """After every token the stream holds back only an incomplete character's bytes: a token that completes one
    character and starts the next sends the first at once (it was held for the next token)."""
    carried = 0
    for text in STREAM_CASES[:3]:
        ids = ours.encode(text)
        decoder, sent = ours.stream_decoder(), ""
        for n, token_id in enumerate(ids):
            piece = decoder.feed(token_id)
            sent += piece
            assert sent == ours.decode(ids[:n + 1]).rstrip("\ufffd") and "\ufffd" not in piece
            carried += ours.decode(ids[:n]).endswith("\ufffd") and ours.decode(ids[:n + 1]).endswith("\ufffd")
        assert sent + decoder.flush() == text
    assert carried  # some token ended one partial character and began another


def test_stream_decoder_flushes_incomplete_character(ours):
    ids = ours.encode("😀")  # 4 bytes over 3 tokens
    decoder = ours.stream_decoder()
    assert decoder.feed(ids[0]) == decoder.feed(ids[1]) == ""
    assert decoder.flush() == ours.decode(ids[:2]) and "\ufffd" in ours.decode(ids[:2])


# The HF-directory path, from the GGUF tokenizer saved by transformers.

@pytest.fixture(scope="module")
def saved_dir(hf_gguf, tmp_path_factory):
    directory = tmp_path_factory.mktemp("smollm2_hf")
    hf_gguf.save_pretrained(directory)
    return directory


@slow
def test_hf_dir_equals_transformers(saved_dir, hf_gguf):
    tok = tokenizer_from_hf_dir(saved_dir)
    assert tok.chat_template == hf_gguf.chat_template
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    for text in CASES:
        assert tok.encode(text) == hf_gguf.encode(text), text


@slow
def test_hf_dir_with_original_pre_tokenizer_equals_gguf(saved_dir, ours, hf_true, tmp_path):
    # SmolLM2's own tokenizer.json layout: the HF path must then equal our GGUF tokenizer everywhere.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((saved_dir / name).read_bytes())
    hf_true.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0, 5]}')
    tok = tokenizer_from_hf_dir(tmp_path)
    for text in CASES:
        assert tok.encode(text) == ours.encode(text), text
    assert tok.stop_token_ids == ours.stop_token_ids | {5}
    assert tok.chat_template == "{{ messages[0]['content'] }}"


def test_hf_dir_errors(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        tokenizer_from_hf_dir(tmp_path)


# GGUF metadata errors name the file and the field.

def test_gguf_metadata_errors(gguf_path):
    metadata = GGUFFile(gguf_path).metadata
    with pytest.raises(TokenizerError, match=r"m\.gguf: tokenizer\.ggml\.pre = 'nope'"):
        tokenizer_from_gguf_metadata({**metadata, "tokenizer.ggml.pre": "nope"}, "m.gguf")
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.model = 'bert' is not supported"):
        tokenizer_from_gguf_metadata({**metadata, "tokenizer.ggml.model": "bert"}, "m.gguf")
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.eos_token_id = 99999"):
        tokenizer_from_gguf_metadata({**metadata, "tokenizer.ggml.eos_token_id": 99999}, "m.gguf")
    with pytest.raises(TokenizerError, match="has no embedded tokenizer"):
        tokenizer_from_gguf_metadata({"general.architecture": "llama"}, "m.gguf")


def test_gguf_reader_rejects_other_files(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="is not a GGUF file"):
        tokenizer_from_gguf(tmp_path / "x.gguf")
    (tmp_path / "t.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 8 + b"\x05" + b"\x00" * 7)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        tokenizer_from_gguf(tmp_path / "t.gguf")


# Pre-tokenizer regexes: the names transformers' GGUF loader also maps must get the same split.

def test_pre_tokenizer_regexes_match_transformers_table():
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    from localmoe.tokenizer import PRE_TOKENIZERS

    for name, regex in mapping.GGUF_PRE_TOKENIZER_SPLITS.items():
        assert PRE_TOKENIZERS[name].splits == (regex,), name
    assert PRE_TOKENIZERS["smollm"].splits == (r"\p{N}", PRE_TOKENIZERS["gpt-2"].splits[0])


# The SentencePiece-style ("llama") path, against llama.cpp's SPM algorithm written out here.

SPM_PIECES = ["\u2581a", "ab", "bc", "\u2581ab", "abc", "\u2581\u2581", "cc", "ca", "\u2581abc", "\u2581c", "ba"]


def _spm_metadata():
    chars = ["\u2581", "a", "b", "c"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + chars + SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * (len(chars) + len(SPM_PIECES))
    scores = [0.0] * 259 + [-100.0 - i for i in range(len(chars))] + [-1.0 - i for i in range(len(SPM_PIECES))]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}


def _llama_cpp_spm(text, metadata):
    """llama.cpp's llm_tokenizer_spm: merge the best-scored adjacent pair (leftmost on ties), bytes for the rest."""
    tokens, scores = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if not text:
        return []
    symbols = list("\u2581" + text.replace(" ", "\u2581"))
    while True:
        pairs = [(scores[vocab[a + b]], -i) for i, (a, b) in enumerate(itertools.pairwise(symbols)) if a + b in vocab]
        if not pairs:
            break
        i = -max(pairs)[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    return [i for s in symbols for i in ([vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()])]


@pytest.fixture(scope="module")
def spm():
    return tokenizer_from_gguf_metadata(_spm_metadata(), "spm.gguf")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.sampled_from("abc é"), max_size=16))
def test_spm_equals_llama_cpp_algorithm(spm, text):
    ids = spm.encode(text, add_special_tokens=False)
    assert ids == _llama_cpp_spm(text, _spm_metadata())
    assert spm.decode(ids) == text
    # Streaming keeps the leading-space strip to the first token only, and é's two byte tokens together.
    pieces = list(spm.stream_decoder()(ids))
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_spm_bos_and_special_tokens(spm):
    assert spm.add_bos_token and spm.stop_token_ids == {2}
    body = spm.encode("ab", add_special_tokens=False)
    assert spm.encode("ab") == [1, *body]
    assert spm.encode("<s>ab") == [1, *body]  # a rendered template's own BOS is not doubled
    assert spm.encode("ab</s>", add_special_tokens=False) == [*body, 2]
    assert spm.decode([1, *body, 2], skip_special_tokens=True) == "ab"


def test_gguf_merges_must_fit_tokens():
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": ["a", "b"],
                "tokenizer.ggml.merges": ["a c"]}
    with pytest.raises(TokenizerError, match=r"bad\.gguf: tokenizer\.ggml\.merges does not fit"):
        tokenizer_from_gguf_metadata(metadata, "bad.gguf")
