"""The CPU kernel library built for each instruction set this CPU runs (kernels/_cpu `ISAS`): every
ISA gives the same bits as the AVX2 baseline, kernel by kernel and for a whole decode of a model. The
baseline itself is checked against the references by the other kernel tests (run them with
LOCALMOE_CPU_ISA=avx2 to make it the library they use); here the other ISAs are held to it. On a
CPU with AVX2 only there is nothing to compare and these tests skip."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from localmoe.kernels import _cpu, dense_gemv, ggml_gemv, gqa_decode, mxfp4_moe
from localmoe.kernels.mxfp4_moe import ExpertTable

from localmoe.config import EngineConfig
from localmoe.load import load_model
from localmoe.quant.mxfp4 import quantize
from localmoe.testing.ggml_blocks import random_blocks
from localmoe.testing.write import write_checkpoint

from .test_gqa_decode import _copies, _paged_case
from .test_mxfp4_moe_layer import _experts, _routing

OTHER_ISAS = [name for name in _cpu.supported_isas() if name != "avx2"] if _cpu.library() is not None else []
pytestmark = pytest.mark.skipif(not OTHER_ISAS, reason="this CPU runs the AVX2 kernels only (or none)")
ISA = pytest.mark.parametrize("isa", OTHER_ISAS)


def _under_each(isa: str, fn):
    """fn() with the AVX2 library, then with `isa`'s (fresh outputs each time)."""
    results = []
    for name in ("avx2", isa):
        with _cpu.forced_isa(name) as lib:
            assert _cpu.library() is lib
            results.append(fn())
    return results


def _same_bits(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    assert a.shape == b.shape, name
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), \
        f"{name}: {(a != b).sum().item()} of {a.numel()} values differ, largest by {(a - b).abs().max().item():.3g}"


def test_isa_choice_and_the_forced_baseline(monkeypatch):
    assert _cpu.supported_isas()[0] == "avx2" and _cpu.isa() in _cpu.supported_isas()
    monkeypatch.setenv("LOCALMOE_CPU_ISA", "avx2")
    assert _cpu.isa() == "avx2"
    monkeypatch.setenv("LOCALMOE_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="LOCALMOE_CPU_ISA=sse2"):
        _cpu.isa()
    monkeypatch.delenv("LOCALMOE_CPU_ISA")
    for name in _cpu.supported_isas():  # what `localmoe run --stats` prints
        with _cpu.forced_isa(name):
            assert _cpu.describe() == f"{name}, {_cpu.threads()} threads"


def test_an_isa_the_cpu_lacks_falls_back_to_avx2_with_a_warning(monkeypatch):
    monkeypatch.setattr(_cpu, "_state", {})  # a fresh load, as in a new process
    monkeypatch.setenv("LOCALMOE_CPU_ISA", "sse9")
    with pytest.warns(UserWarning, match="LOCALMOE_CPU_ISA=sse9: this CPU runs avx2"):
        lib = _cpu.library()
    assert lib is not None and _cpu.describe().startswith("avx2,")


@ISA
@pytest.mark.parametrize("O,K", [(67, 224), (96, 64), (9, 32), (130, 512), (40, 2880), (33, 384)], ids=lambda v: str(v))
@pytest.mark.parametrize("N", [1, 2, 5, 7, 100])
@pytest.mark.parametrize("precision", ["exact", "q8"])
def test_mxfp4_linear(isa, precision, O, K, N):
    """Odd block counts, row counts that are not a multiple of the row group, extreme and NaN scales; last groups of
    1-4 blocks (32, 64, 384, 2880: rows sharing them in pairs)."""
    g = torch.Generator().manual_seed(O * K + N)
    packed, scales = quantize(torch.randn(O, K, generator=g) * torch.logspace(-3, 1, O).unsqueeze(1))
    scales[0, 0], scales[1, -1], scales[2, 0] = 0, 200, 255
    x = torch.randn(N, K, generator=g)
    x[0, 5] *= 1000
    _same_bits(*_under_each(isa, lambda: mxfp4_moe.mxfp4_linear(x, packed, scales, precision=precision)),
               f"{precision} {O}x{K} N={N}")


@ISA
@pytest.mark.parametrize("precision", ["exact", "q8"])
@pytest.mark.parametrize("N", [1, 3, 9])
def test_mxfp4_moe_layer(isa, precision, N):
    E, D, I, k = 6, 224, 96, 2
    table = ExpertTable(_experts(E, D, I, seed=N), E)
    ids, weights = _routing(N, E, k, seed=N)
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(N))

    def layer():
        return mxfp4_moe.mxfp4_moe(x, ids, weights, table, "gpt_oss", (7.0, 1.702), torch.zeros(N, D),
                                   precision=precision)

    _same_bits(*_under_each(isa, layer), f"{precision} N={N}")


@ISA
@pytest.mark.parametrize("ggml_type", sorted(ggml_gemv.TYPES, key=int), ids=lambda t: t.name)
@pytest.mark.parametrize("N", [1, 3, 9, 19])  # past AVX2's tile of 4 tokens and AVX-512's of 8 (Q4_0 / Q4_1 / Q8_0: 16)
def test_ggml_gemv(isa, ggml_type, N):
    O, K = 43, 512  # 43: Q4_0 / Q4_1 / Q8_0 rows in groups of eight and three alone
    blocks = torch.from_numpy(random_blocks(ggml_type, O, K, np.random.default_rng(int(ggml_type))))
    x = torch.randn(N, K, generator=torch.Generator().manual_seed(N))
    modes = [{}] + [{"exact_x": True}] * (ggml_type in ggml_gemv.EXACT_X_TYPES) + [{"x16": True}] * (
        ggml_type in ggml_gemv.X16_TYPES)  # x16: sixteen rows a vector on AVX-512, eight on AVX2
    for mode in modes:
        run = functools.partial(ggml_gemv.ggml_gemv, x, blocks, ggml_type, (O, K), **mode)
        _same_bits(*_under_each(isa, run), f"{ggml_type.name} N={N} {mode}")


@ISA
@pytest.mark.parametrize("plain", [ggml_gemv.Q.Q4_1, ggml_gemv.Q.Q4_K, ggml_gemv.Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("N", [1, 3, 9, 19])
def test_ggml_gemv_repacked(isa, plain, N):
    """Q4_1 / Q4_K / Q6_K repacked at load (Q4_1_R8 / Q4_K_R8 / Q6_K_R8: one-token rows without transposition, tiles
    on the repacked bytes; Q4_1_R8: sixteen rows a vector on AVX-512, eight on AVX2)."""
    from localmoe.kernels.ggml_gemv.repacked import repack

    O, K = 48, 512
    blocks = torch.from_numpy(random_blocks(plain, O, K, np.random.default_rng(12)))
    x = torch.randn(N, K, generator=torch.Generator().manual_seed(N))
    packed, kind = repack(blocks, plain, O)  # the same bytes whichever library repacks
    run = functools.partial(ggml_gemv.ggml_gemv, x, packed, kind, (O, K))
    _same_bits(*_under_each(isa, run), f"{kind.name} N={N}")


@ISA
@pytest.mark.parametrize("N", [1, 3, 9, 19])
def test_ggml_gemv_x16_repacked(isa, N):
    """A Q8_0 x16 head repacked at load (Q8_0_R16: AVX-512 one token through int16 pairs, 2-16 through x's bytes;
    AVX2 eight rows a vector)."""
    from localmoe.kernels.ggml_gemv.repacked import repack

    O, K = 48, 512
    blocks = torch.from_numpy(random_blocks(ggml_gemv.Q.Q8_0, O, K, np.random.default_rng(13)))
    x = torch.randn(N, K, generator=torch.Generator().manual_seed(N))
    packed, kind = repack(blocks, ggml_gemv.Q.Q8_0, O, x16=True)
    run = functools.partial(ggml_gemv.ggml_gemv, x, packed, kind, (O, K), x16=True)
    _same_bits(*_under_each(isa, run), f"{kind.name} N={N}")


@ISA
def test_gqa_decode_paged(isa):
    """The batched decode attention over paged caches (shuffled tables, two rows sharing a cache, sinks)."""
    q, k, v, caches, positions = _paged_case(6, 8, 2, 64, 16, [5, 70, 130, 0, 33, 34], [(4, 5)], seed=9)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2))

    def run():
        mine = _copies(caches)
        out = gqa_decode.gqa_decode_paged(q, k, v, mine, positions, [0, 0, 100, 0, 2, 2], 0.125, sinks)
        return torch.cat([out.view(-1)] + [c.key_pool.view(-1) for c in mine] + [c.value_pool.view(-1) for c in mine])

    _same_bits(*_under_each(isa, run), "gqa_decode_paged")


@ISA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N,O,K", [(3, 200, 96), (1, 67, 2051), (7, 67, 2051), (64, 130, 2048), (70, 37, 2051)],
                         ids=str)
def test_dense_gemv(isa, dtype, N, O, K):
    """One token's row stream and the register tiles of several (AVX-512: 4 x 5 zmm lanes, AVX2: 3 x 3 ymm)."""
    g = torch.Generator().manual_seed(3)
    w, x, b = torch.randn(O, K, generator=g).to(dtype), torch.randn(N, K, generator=g), torch.randn(O, generator=g)
    _same_bits(*_under_each(isa, lambda: dense_gemv.dense_gemv(x, w, b)), f"{dtype} N={N} {O}x{K}")


@ISA
@pytest.mark.parametrize("per_head", [False, True], ids=["kda", "gated_delta"])
def test_delta_rule_tokens(isa, per_head):
    """The prefill delta rule (kernels/kda/native.py: the decode step's one-token update over a chunk)."""
    from localmoe.kernels.kda import native

    g_ = torch.Generator().manual_seed(11)
    B, T, H, K, V = 2, 37, 3, 40, 24
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g_), dim=-1) * K ** -0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g_), dim=-1)
    v = torch.randn(B, T, H, V, generator=g_)
    g = -torch.rand(*((B, T, H) if per_head else (B, T, H, K)), generator=g_) * 3.0
    beta, state = torch.rand(B, T, H, generator=g_), torch.randn(B, H, K, V, generator=g_) * 0.1
    (o1, s1), (o2, s2) = _under_each(isa, lambda: native.delta_rule(q, k, v, g, beta, state, scalar_decay=per_head))
    _same_bits(o1, o2, "o")
    _same_bits(s1, s2, "state")


@ISA
@pytest.mark.parametrize("mixer", ["kimi_linear", "kimi_k3", "gated_deltanet", "mla"])
def test_prefill_mixers(isa, mixer):
    """The KDA / Gated DeltaNet prefill mixers between their projections (kernels/kda/native.py `kda_chunk`,
    `gdn_chunk`): output, state and conv tail, a left-padded row included; MLA's (kernels/mla_decode/native.py
    `mla_chunk`): the output of 37 queries over 150 rows, value widths that leave lanes past the last 8."""
    from localmoe.kernels.kda import native
    from localmoe.kernels.mla_decode import native as mla_native

    g_ = torch.Generator().manual_seed(12)
    B, T, K, W = 2, 37, 40, 4
    valid = torch.ones(B, T)
    valid[1, :5] = 0.0
    if mixer == "mla":
        H, r, nope, rope, v, S = 3, 20, 12, 4, 10, 150
        rows = torch.randn(B, S + 7, r + rope, generator=g_)[:, :S]
        q = torch.randn(B, T, H, nope + rope, generator=g_)
        w_uk, w_uv = torch.randn(H, nope, r, generator=g_) * 0.3, torch.randn(H, v, r, generator=g_) * 0.3
        run = lambda: (mla_native.mla_chunk(q, rows, w_uk, w_uv, 0.25),)  # noqa: E731
    elif mixer == "gated_deltanet":
        Hk, Hv, V = 2, 6, 24
        C = 2 * Hk * K + Hv * V
        y = torch.randn(B, T, C + Hv * V + 2 * Hv, generator=g_)
        state, tail = torch.randn(B, Hv, K, V, generator=g_) * 0.1, torch.randn(B, W - 1, C, generator=g_)
        weights = (torch.randn(C, W, generator=g_) * 0.5, torch.rand(Hv, generator=g_) * 4,
                   torch.randn(Hv, generator=g_), torch.rand(V, generator=g_) + 0.5)
        run = lambda: native.gdn_chunk(y.clone(), valid, state, tail, *weights, Hk, 1e-6)  # noqa: E731
    else:
        H, bounded = 3, mixer == "kimi_k3"
        C = 3 * H * K
        y = torch.randn(B, T, C + K + H + (H * K if bounded else K), generator=g_)
        f, gate = torch.randn(B, T, H * K, generator=g_), torch.randn(B, T, H * K, generator=g_)
        state, tail = torch.randn(B, H, K, K, generator=g_) * 0.1, torch.randn(B, W - 1, C, generator=g_)
        weights = (torch.randn(C, W, generator=g_) * 0.5, torch.rand(H, generator=g_) * 4,
                   torch.randn(H * K, generator=g_), torch.rand(K, generator=g_) + 0.5)

        def run():
            yy = y.clone()
            return native.kda_chunk(yy, f.clone(), yy[..., C + K + H:] if bounded else gate, valid, state, tail,
                                    *weights, bounded, -5.0, 1e-5)
    for a, b, name in zip(*_under_each(isa, run), ("o", "state", "tail")):
        _same_bits(a, b, name)


@ISA
@pytest.mark.parametrize("precision", ["exact", "q8"])
def test_gpt_oss_decode(isa, precision, tmp_path_factory):
    """A tiny gpt-oss (MXFP4 experts) prefilled and decoded greedily through the decode plan: the
    logits of every step."""
    path = write_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"), "tiny")
    model = load_model(path, EngineConfig(dtype="float32", threads=2, expert_precision=precision)).model
    prompt = torch.tensor([[5, 17, 230, 9]])

    def decode():
        cache = model.new_cache(1, 16)
        logits = [model.forward(prompt, cache)[:, -1]]
        for _ in range(5):
            logits.append(model.forward(logits[-1].argmax(-1, keepdim=True), cache)[:, -1])
        return torch.cat(logits)

    _same_bits(*_under_each(isa, decode), precision)
