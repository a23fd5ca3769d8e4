"""The lossless acceptance rule: which drafted tokens a speculative step keeps (pure functions).

Greedy: the target's own token at each position (`sample` on its logits: the argmax of the penalised
logits, exactly what plain decoding picks), drafts kept while they agree; the first disagreement is
replaced by the target's token, and after k agreements the target's next token comes free.

Sampling (Leviathan et al. 2023, Chen et al. 2023): draft d_i drawn from q_i is kept with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is drawn from the residual
max(p_i - q_i, 0) (normalised), and after k acceptances from p_k. Each emitted token is then
distributed exactly as p: the draft changes only how many tokens a step yields. A deterministic
drafter (prompt lookup) has a one-hot q: a draft is kept with probability p_i(d_i), and a rejected
position draws from p_i without d_i.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def accept_greedy(drafts: Sequence[int], target: Callable[[int], int]) -> tuple[int, int]:
    """`target(i)`: the target's token at row i (after the last token and drafts[:i]). Returns (j, x):
    the first j drafts are kept and x follows them."""
    for i, d in enumerate(drafts):
        x = target(i)
        if x != d:
            return i, x
    return len(drafts), target(len(drafts))


def accept_sampled(drafts: Sequence[int], q: torch.Tensor | None, p: Callable[[int], torch.Tensor],
                   generator: torch.Generator | None) -> tuple[int, int]:
    """Rejection sampling. `q` [k, V]: the distributions the drafts were drawn from (None: deterministic
    drafts, one-hot); `p(i)` [V]: the target's distribution at row i (`sampler.probabilities`). Returns (j, x)."""
    for i, d in enumerate(drafts):
        p_i = p(i)
        q_d = 1.0 if q is None else float(q[i, d])
        r = float(torch.rand((), generator=generator))
        if r * q_d < float(p_i[d]):  # kept with probability min(1, p/q)
            continue
        if q is None:
            residual = p_i.clone()
            residual[d] = 0.0
        else:
            residual = (p_i - q[i]).clamp(min=0.0)
        if not float(residual.sum()) > 0.0:  # p == q up to rounding: the rejection cannot happen in exact terms
            residual = p_i
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(drafts), int(torch.multinomial(p(len(drafts)), 1, generator=generator))
