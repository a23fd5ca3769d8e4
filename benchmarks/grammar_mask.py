"""Per-token cost of constrained JSON decoding: llguidance, xgrammar and the hand-written
character validator that localmoe used before (kept here, in `_handwritten_constrain.py`,
only as the peer to measure against).

For each vocabulary (the embedded SmolLM2's 49,152 tokens and a Kimi K3-sized 163,840:
SmolLM2's byte-level BPE extended with merges of its own tokens, so token texts stay
realistic) and a tool-arguments-like JSON schema, a fixed valid document is tokenised and
walked token by token; at each step every engine computes which tokens may come next
(the mask) and then takes the document's token. Prints the median and p95 mask time per
token, grammar compile time and tokenizer setup time, and each engine's ratio to
llguidance. The hand-written validator is measured two ways: a full mask (every token
text stepped through the character automaton) and `choose_token` at temperature 0.7 on
random logits (it stops after the first 64 ranks that hold a valid token).

    .venv/bin/python benchmarks/grammar_mask.py [--steps 40]   (pip install xgrammar to include it)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import torch
from common import report

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
        "hourly": {"type": "boolean"},
        "fields": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"city": "Berlin and the surrounding area", "unit": "celsius", "days": 14, "hourly": True,
                       "fields": ["temperature", "wind speed", "rain"]})
K3_VOCAB = 163_840


def smollm2_backend():
    from localmoe.default_model import default_model_path
    from localmoe.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(default_model_path())


def widened(tokenizer, size: int):
    """`tokenizer` with merges of its own tokens appended until the vocabulary has `size` ids."""
    from tokenizers import Tokenizer

    from localmoe.tokenizer import Tokenizer as Ours

    data = json.loads(tokenizer.backend.to_str())
    vocab: dict = data["model"]["vocab"]
    merges: list = data["model"]["merges"]
    added = {t["content"] for t in data.get("added_tokens", [])}
    ordinary = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in added][200:1200]
    next_id = max(max(vocab.values()), max((t["id"] for t in data.get("added_tokens", [])), default=0)) + 1
    for a in ordinary:
        for b in ordinary:
            if next_id >= size:
                break
            if a + b not in vocab:
                vocab[a + b] = next_id
                merges.append([a, b] if isinstance(merges[0], list) else f"{a} {b}")
                next_id += 1
    backend = Tokenizer.from_str(json.dumps(data))
    return Ours(backend, source=f"synthetic-{size}", bos_token_id=None, eos_token_id=tokenizer.eos_token_id)


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def full_mask(hc, state, texts) -> list:
    return [hc.advance(state, t) for t in texts.texts if t is not None]


def run_llguidance(tok, ids: list[int]) -> dict:
    import llguidance
    import llguidance.torch as lltorch

    setup = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=tok.eos_token_id)
    setup = time.perf_counter() - setup
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - start
    assert not matcher.is_error(), matcher.get_error()
    mask = lltorch.allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for token in ids:
        times.append(timed(lltorch.fill_next_token_bitmask, matcher, mask, 0))
        assert matcher.consume_token(token), matcher.get_error()
    return {"setup": setup, "compile": compile_s, "times": times}


def run_xgrammar(tok, ids: list[int]) -> dict:
    import xgrammar

    setup = time.perf_counter()
    vocab = [None] * tok.vocab_size
    for text, i in tok.backend.get_vocab(with_added_tokens=True).items():
        vocab[i] = text
    info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=tok.vocab_size,
                                  stop_token_ids=[tok.eos_token_id])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    setup = time.perf_counter() - setup
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    matcher = xgrammar.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - start
    mask = xgrammar.allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for token in ids:
        times.append(timed(matcher.fill_next_token_bitmask, mask))
        assert matcher.accept_token(token)
    return {"setup": setup, "compile": compile_s, "times": times}


def run_handwritten(tok, ids: list[int], sampled: bool) -> dict:
    import _handwritten_constrain as hc

    setup = time.perf_counter()
    texts = hc.TokenTexts.for_tokenizer(tok)
    setup = time.perf_counter() - setup
    state = hc.initial_state(SCHEMA)
    generator = torch.Generator().manual_seed(0)
    times = []
    for token in ids:
        if sampled:
            logits = torch.randn(tok.vocab_size, generator=generator)
            times.append(timed(hc.choose_token, logits, state, texts, 0.7, generator))
        else:
            times.append(timed(full_mask, hc, state, texts))
        state = hc.advance(state, texts.texts[token])
        if state is None:
            raise AssertionError(f"the hand-written validator rejects token {token!r} of the document")
    return {"setup": setup, "compile": 0.0, "times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="document tokens walked per engine")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = smollm2_backend()
    for name, tok in (("SmolLM2 (49,152)", base), ("K3-sized (163,840)", widened(base, K3_VOCAB))):
        ids = tok.encode(DOCUMENT, add_special_tokens=False)[:args.steps]
        print(f"{name}: vocabulary {tok.vocab_size}, {len(ids)} document tokens")
        results = {"llguidance": run_llguidance(tok, ids)}
        if importlib.util.find_spec("xgrammar") is not None:
            results["xgrammar"] = run_xgrammar(tok, ids)
        else:
            print("  (xgrammar is not installed: pip install xgrammar to compare it)")
        results |= {"hand-written, full mask": run_handwritten(tok, ids, sampled=False),
                   "hand-written, choose_token T=0.7": run_handwritten(tok, ids, sampled=True)}
        peer = statistics.median(results["llguidance"]["times"])
        rows = []
        for engine, r in results.items():
            median = statistics.median(r["times"])
            p95 = sorted(r["times"])[int(0.95 * (len(r["times"]) - 1))]
            rows.append((engine, (f"mask {median * 1e6:9.1f} us median, {p95 * 1e6:9.1f} us p95 "
                                  f"({median / peer:6.1f}x llguidance); compile {r['compile'] * 1e3:7.1f} ms; "
                                  f"setup {r['setup']:5.2f} s")))
        report(rows)


if __name__ == "__main__":
    main()
