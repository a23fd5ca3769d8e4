"""Pieces shared by the family tests (tests/models/test_<family>.py, tests/engine/test_batching.py):
loading the tiny checkpoint as ours and as a transformers reference, our model against that
reference, and our model against itself (chunked prefill + cached decode, batch against single rows)."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from localmoe.config import EngineConfig
from localmoe.load import load_model
from localmoe.testing.write import write_checkpoint


def run_mixer(mixer, x: torch.Tensor, chunks: list[int], mask: torch.Tensor | None = None) -> torch.Tensor:
    """Feed x [B, T, D] through one mixer (a layer kind's `build`) in calls of `chunks` tokens over its own cache
    (on the mixer's device; mask [B, T] for left padding)."""
    from localmoe.engine.cache import ModelCache
    from localmoe.engine.step import make_step

    B, T, _ = x.shape
    cache = ModelCache([mixer.new_cache(B, T)], B, T, mixer.device)
    outs = []
    for n in chunks:
        start = cache.reserve(n)
        cache.append_mask(None if mask is None else mask[:, start:start + n], n)
        outs.append(mixer(x[:, start:start + n], make_step(cache, start, n, None), cache.layers[0]))
        cache.advance(n)
    return torch.cat(outs, dim=1)


def assert_native_mixer_matches_op(module, entry: str, mixer, x: torch.Tensor, mask: torch.Tensor | None,
                                   monkeypatch, available: str = "mixer_available") -> None:
    """A layer's C++ prefill mixer (`module.<entry>`: kda_chunk, gdn_chunk, mla_chunk) against its op-by-op form:
    x [B, T, D] in one call, in 13 + 1 + the rest, and one token at a time all run it (counted) with the same bits,
    within 1e-5 of the op-by-op layer's output range (`module.<available>` patched off for it)."""
    T = x.shape[1]
    calls, native = [], getattr(module, entry)
    monkeypatch.setattr(module, entry, lambda *a, **k: calls.append(a[0].shape) or native(*a, **k))
    fused = [run_mixer(mixer, x, chunks, mask) for chunks in ([T], [13, 1, T - 14], [1] * T)]
    assert len(calls) == 1 + 3 + T  # the C++ path ran
    monkeypatch.setattr(module, available, lambda *dims: False)
    op = run_mixer(mixer, x, [T], mask)
    for out in fused[1:]:
        assert torch.equal(out, fused[0])
    span = float(op.max() - op.min())
    assert (fused[0] - op).abs().max() <= 1e-5 * span


def tiny_checkpoint(model_type: str, tmp_path_factory) -> Path:
    """The family's tiny generated checkpoint (seed 0) in a fresh temporary directory."""
    return write_checkpoint(model_type, tmp_path_factory.mktemp(model_type), "tiny", seed=0)


def copy_with_config(checkpoint: Path, dest: Path, edit: Callable[[dict], None]) -> Path:
    """`checkpoint` copied to `dest` with `edit` applied to its config.json (in place on the dict)."""
    shutil.copytree(checkpoint, dest, dirs_exist_ok=True)
    config = json.loads((dest / "config.json").read_text())
    edit(config)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def load_ours(path: Path, expert_precision: str = "exact"):
    """Our model of the checkpoint at `path` in fp32 on one thread (a `load_model` result), MXFP4
    experts with fp32 activations by default: the references compute in fp32 or float64."""
    return load_model(path, EngineConfig(dtype="float32", threads=1, expert_precision=expert_precision),
                      progress=False)


def load_reference(auto_class, path: Path, **kwargs):
    """`auto_class.from_pretrained(path, dtype=torch.float32, **kwargs)` in eval mode, load warnings
    silenced; the family test names its transformers class and any options it needs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return auto_class.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


@contextmanager
def kv_cache_dtype(model, dtype: str) -> Iterator[None]:
    """Inside the block `model.new_cache` makes `dtype` caches (EngineConfig.kv_cache_dtype of the
    loaded model, restored on the way out)."""
    before = model.config.kv_cache_dtype
    model.config.kv_cache_dtype = dtype
    try:
        yield
    finally:
        model.config.kv_cache_dtype = before


@contextmanager
def earliest_ties() -> Iterator[None]:
    """`Tensor.topk` (largest first) keeps the lower index of equal values while inside: a valid torch.topk
    (which leaves the tie order unspecified) with the DSA indexers' tie rule (kernels/topk_select), so a
    transformers reference selects the same tokens as the engine where relu-zero scores tie."""
    original = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        if not largest:
            return original(self, k, dim, largest, sorted)
        values, indices = torch.sort(self, dim=dim, descending=True, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


def load_pair(path: Path, auto_class, **kwargs):
    """(ours, transformers reference) of the checkpoint at `path`; see `load_ours`, `load_reference`."""
    return load_ours(path), load_reference(auto_class, path, **kwargs)


def random_tokens(n: int, seed: int, vocab: int, batch: int = 1) -> torch.Tensor:
    """[batch, n] token ids, deterministic by seed."""
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max abs diff, max abs diff relative to b's largest magnitude)."""
    err = (a - b).abs().max().item()
    return err, err / b.abs().max().clamp(min=1e-6).item()


def assert_prefill_and_greedy_decode_match(model, reference, prompt: torch.Tensor, decode_steps: int,
                                           rtol: float = 1e-3) -> None:
    """Logits of a prefill of `prompt` [1, T] and of `decode_steps` cached greedy steps stay within
    `rtol` (relative to the reference's largest logit) of the transformers `reference`, and
    every greedy token is the same."""
    with torch.no_grad():
        out = reference(prompt, use_cache=True)
    expected, past = out.logits, out.past_key_values
    got = model.forward(prompt, cache := model.new_cache(1, prompt.shape[1] + decode_steps), all_logits=True)
    err, rel = max_diff(got, expected)
    assert rel < rtol, f"prefill logits: max abs {err:.2e}, rel {rel:.2e}"
    ours_next = ref_next = got[:, -1].argmax(-1, keepdim=True)
    for step in range(decode_steps):
        with torch.no_grad():
            out = reference(ref_next, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = model.forward(ours_next, cache)
        err, rel = max_diff(logits[:, -1], out.logits[:, -1])
        assert rel < rtol, f"decode step {step}: max abs {err:.2e}, rel {rel:.2e}"
        ours_next, ref_next = logits[:, -1].argmax(-1, keepdim=True), out.logits[:, -1].argmax(-1, keepdim=True)
        assert ours_next.item() == ref_next.item(), f"greedy token differs at decode step {step}"


def prefill_in_chunks_then_decode(model, tokens: torch.Tensor, prefill_ends: Sequence[int], cache) -> torch.Tensor:
    """All logits [1, T, V] of `tokens` [1, T] fed into `cache` as prefills ending at each of
    `prefill_ends`, then as one cached decode step per remaining token."""
    starts = (0, *prefill_ends[:-1])
    parts = [model.forward(tokens[:, s:e], cache, all_logits=True) for s, e in zip(starts, prefill_ends)]
    parts += [model.forward(tokens[:, t:t + 1], cache) for t in range(prefill_ends[-1], tokens.shape[1])]
    return torch.cat(parts, dim=1)


def assert_chunked_prefill_and_decode_equal_full(model, tokens: torch.Tensor, prefill_ends: Sequence[int],
                                                 max_len: int, rtol: float, atol: float):
    """`prefill_in_chunks_then_decode` equals one full forward of `tokens` [1, T] within
    (`rtol`, `atol`) elementwise; returns the chunked run's cache."""
    full = model.forward(tokens, model.new_cache(1, max_len), all_logits=True)
    cache = model.new_cache(1, max_len)
    got = prefill_in_chunks_then_decode(model, tokens, prefill_ends, cache)
    torch.testing.assert_close(got, full, rtol=rtol, atol=atol)
    return cache


def assert_batch_equals_single(model, batch: torch.Tensor, max_len: int, rtol: float, atol: float) -> None:
    """All logits of one forward over `batch` [B, T] (no padding) equal each row's run alone
    within (`rtol`, `atol`) elementwise."""
    both = model.forward(batch, model.new_cache(batch.shape[0], max_len), all_logits=True)
    for row in range(batch.shape[0]):
        single = model.forward(batch[row:row + 1], model.new_cache(1, max_len), all_logits=True)
        torch.testing.assert_close(both[row:row + 1], single, rtol=rtol, atol=atol)
