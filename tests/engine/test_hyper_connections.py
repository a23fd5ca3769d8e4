"""GLM-5-Next hyper-connections against a float64 per-token re-derivation with explicit loops
(normalised flatten, sigmoid / softmax weights, Sinkhorn, collapse, spread + stream mix, final mean)."""

from __future__ import annotations

import math

import pytest
import torch

from localmoe.engine.layers.hyper_connections import HyperConnection, HyperConnections, sinkhorn

N, D, NORM_EPS, HC_EPS, ITERS = 3, 8, 1e-5, 1e-6, 20


def make(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    W = (2 + N) * N
    return (torch.randn(W, N * D, generator=g) * 0.3, torch.randn(W, generator=g) * 0.5,
            torch.rand(3, generator=g) + 0.5)


def sublayer_weight(seed: int) -> torch.Tensor:
    return torch.randn(D, D, generator=torch.Generator().manual_seed(100 + seed)) * 0.5


def reference_step(X: list[list[float]], fn, base, scale, W_sub) -> list[list[float]]:
    """One token's N streams (lists of D floats) through one hyper-connected sublayer, float64."""
    fn, base, scale, W_sub = fn.double(), base.double(), scale.double(), W_sub.double()
    z = [v for stream in X for v in stream]
    rms = math.sqrt(sum(v * v for v in z) / len(z) + NORM_EPS)
    z = [v / rms for v in z]
    m = [sum(float(fn[r, c]) * z[c] for c in range(len(z))) for r in range(fn.shape[0])]

    def sig(v: float) -> float:
        return 1 / (1 + math.exp(-v))

    pre = [sig(m[n] * float(scale[0]) + float(base[n])) + HC_EPS for n in range(N)]
    post = [2 * sig(m[N + n] * float(scale[1]) + float(base[N + n])) for n in range(N)]
    C = [[m[2 * N + i * N + j] * float(scale[2]) + float(base[2 * N + i * N + j]) for j in range(N)] for i in range(N)]
    C = [[math.exp(v) / sum(math.exp(u) for u in row) + HC_EPS for v in row] for row in C]

    def columns(C):
        sums = [sum(C[i][j] for i in range(N)) + HC_EPS for j in range(N)]
        return [[C[i][j] / sums[j] for j in range(N)] for i in range(N)]

    C = columns(C)
    for _ in range(ITERS - 1):
        C = [[v / (sum(row) + HC_EPS) for v in row] for row in C]
        C = columns(C)
    h = [sum(pre[n] * X[n][d] for n in range(N)) for d in range(D)]
    y = [math.tanh(sum(float(W_sub[e, d]) * h[d] for d in range(D))) for e in range(D)]
    return [[post[n] * y[d] + sum(C[m_][n] * X[m_][d] for m_ in range(N)) for d in range(D)] for n in range(N)]


def test_one_sublayer_matches_float64_loops():
    fn, base, scale = make(0)
    W_sub = sublayer_weight(0)
    streams = torch.randn(2, 3, N, D, generator=torch.Generator().manual_seed(1))
    hc = HyperConnection(fn, base, scale, N, NORM_EPS, HC_EPS, ITERS)
    got = hc(streams, lambda h: torch.tanh(h @ W_sub.T))
    for b in range(2):
        for t in range(3):
            want = torch.tensor(reference_step(streams[b, t].tolist(), fn, base, scale, W_sub), dtype=torch.float64)
            torch.testing.assert_close(got[b, t].double(), want, rtol=1e-5, atol=1e-6)


def test_sinkhorn_makes_rows_and_columns_sum_to_one():
    comb = torch.rand(4, N, N, generator=torch.Generator().manual_seed(2)) + 0.05
    out = sinkhorn(comb, ITERS, HC_EPS)
    torch.testing.assert_close(out.sum(-2), torch.ones(4, N), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.sum(-1), torch.ones(4, N), rtol=0, atol=1e-3)


@pytest.mark.parametrize("layers", [1, 2], ids=["one_layer", "two_layers"])
def test_run_expands_mixes_every_sublayer_and_averages(layers):
    weights = [make(10 + k) for k in range(2 * layers)]
    subs = [sublayer_weight(k) for k in range(2 * layers)]
    hcs = [HyperConnection(*w, N, NORM_EPS, HC_EPS, ITERS) for w in weights]
    model = HyperConnections(hcs[0::2], hcs[1::2], N)
    x = torch.randn(1, 2, D, generator=torch.Generator().manual_seed(3))
    got = model.run(x, lambda i, h: torch.tanh(h @ subs[2 * i].T), lambda i, h: torch.tanh(h @ subs[2 * i + 1].T))
    for t in range(2):
        X = [x[0, t].tolist()] * N  # the embedding as N equal streams
        for k in range(2 * layers):
            X = reference_step(X, *weights[k], subs[k])
        want = torch.tensor([sum(X[n][d] for n in range(N)) / N for d in range(D)], dtype=torch.float64)
        torch.testing.assert_close(got[0, t].double(), want, rtol=1e-5, atol=1e-6)
