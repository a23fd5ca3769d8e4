"""Checks shared by the family parity tests: our model against a transformers reference."""

from __future__ import annotations

import torch


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
