"""MXFP4 codec: lossless repacks between the canonical, gpt-oss and ggml layouts; dequantise
bit-exact against numpy references (ours and gguf's); quantise equal to an exact numpy
reference, within the documented error bound, ties to even, and the special values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from localmoe.errors import CheckpointError
from localmoe.quant import mxfp4
from localmoe.quant.mxfp4 import (
    canonical_to_ggml,
    canonical_to_gpt_oss,
    dequantize,
    ggml_to_canonical,
    gpt_oss_to_canonical,
    interleave_gate_up,
    quantization_error,
    quantize,
    split_gate_up_interleaved,
)

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
SPECIAL_SCALES = [0, 1, 2, 126, 127, 128, 252, 253, 254, 255]
# per-element error bound of each scale rule: |err| <= max(|x| * rel, amax * floor, 2^-129)
BOUNDS = {"midpoint": (1 / 5, 1 / 14), "ocp": (1 / 4, 1 / 16), "no_clip": (1 / 5, 1 / 12)}
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- independent numpy references ----

def ref_dequantize(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Canonical layout -> float64, element by element from the OCP definition."""
    codes = np.stack((packed & 0xF, packed >> 4), axis=-1).reshape(*packed.shape[:-1], -1)
    mag = GRID[codes & 7]
    value = np.where(codes & 8, -mag, mag)  # -0.0 for code 8
    exp = np.repeat(scales.astype(np.int64) - 127, 32, axis=-1)
    return np.where(exp == 128, np.nan, np.ldexp(value, np.minimum(exp, 127)))


def ref_dequantize_gpt_oss(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """gpt-oss `[..., G, 16]` blocks, as transformers' convert_moe_packed_tensors reads them:
    the low nibble is the even element; then ldexp by scale - 127 (0xFF -> NaN here)."""
    out = np.empty((*blocks.shape[:-1], 32))
    out[..., 0::2] = GRID[blocks & 7] * np.where(blocks & 8, -1.0, 1.0)
    out[..., 1::2] = GRID[(blocks >> 4) & 7] * np.where(blocks & 0x80, -1.0, 1.0)
    exp = scales.astype(np.int64)[..., None] - 127
    out = np.where(exp == 128, np.nan, np.ldexp(out, np.minimum(exp, 127)))
    return out.reshape(*blocks.shape[:-2], -1)


def ref_quantize(x: np.ndarray, limit: float) -> tuple[np.ndarray, np.ndarray]:
    """float64 `[..., K]` -> canonical (packed, scales) by search: the smallest scale s with
    amax <= limit * 2^s (< 8 * 2^s for "ocp"), then the nearest grid value, ties to the even code."""
    blocks = x.reshape(-1, 32)
    with np.errstate(invalid="ignore"):
        amax = np.abs(blocks).max(axis=-1)
    finite = np.isfinite(amax)
    _, e = np.frexp(np.where(finite, amax, 1.0))
    cand = e[:, None] + np.arange(-5, 2)  # the answer lies among these exponents
    bound = np.ldexp(float(limit), cand)
    ok = amax[:, None] < bound if limit == 8 else amax[:, None] <= bound
    s = cand[np.arange(len(cand)), ok.argmax(axis=-1)]
    s = np.where(amax == 0, -127, np.maximum(s, -127))
    bad = ~finite | (s > 127)
    y = np.minimum(np.abs(np.where(bad[:, None], 0.0, blocks)) / np.ldexp(1.0, np.where(bad, 0, s))[:, None], 6.0)
    dist = np.abs(y[..., None] - GRID)
    tied = dist == dist.min(axis=-1, keepdims=True)
    codes = np.argmax(tied * (2 - np.arange(8) % 2), axis=-1)  # prefer the even code among ties
    codes = (codes | np.signbit(blocks) * 8).astype(np.uint8)
    codes[bad] = 0
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = np.where(bad, 255, s + 127).astype(np.uint8)
    return packed.reshape(*x.shape[:-1], -1), scales.reshape(*x.shape[:-1], -1)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same dtype, shape and bits, except that any NaN matches any NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(got)
    assert torch.equal(nan, torch.isnan(want))
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[got.element_size()]
    assert torch.equal(got.masked_fill(nan, 0).view(ints), want.masked_fill(nan, 0).view(ints))


# ---- strategies ----

scale_bytes = st.one_of(st.sampled_from(SPECIAL_SCALES), st.integers(0, 255))


@st.composite
def mxfp4_tensors(draw):
    """Random canonical (packed [..., K/2], scales [..., K/32]): any codes, scales with the specials."""
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    groups = draw(st.integers(1, 4))
    packed = draw(hnp.arrays(np.uint8, (*lead, groups * 16), elements=st.integers(0, 255)))
    scales = draw(hnp.arrays(np.uint8, (*lead, groups), elements=scale_bytes))
    return torch.from_numpy(packed), torch.from_numpy(scales)


# ---- lossless repacks ----

@SETTINGS
@given(mxfp4_tensors())
def test_repacks_round_trip_byte_identical_and_dequantise_equal(t):
    packed, scales = t
    want = dequantize(packed, scales, torch.float64)
    assert_same(want, torch.from_numpy(ref_dequantize(packed.numpy(), scales.numpy())))

    blocks, gs = canonical_to_gpt_oss(packed, scales)
    assert blocks.shape == (*scales.shape, 16) and gs.shape == scales.shape
    assert_same(torch.from_numpy(ref_dequantize_gpt_oss(blocks.numpy(), gs.numpy())), want)
    ggml = canonical_to_ggml(packed, scales)
    assert ggml.shape == (*scales.shape, 17) and ggml.dtype == torch.uint8

    # every pair of layouts, each way: the bytes come back identical and decode the same
    back = {"gpt-oss": gpt_oss_to_canonical(blocks, gs), "ggml": ggml_to_canonical(ggml)}
    back["gpt-oss -> ggml"] = ggml_to_canonical(canonical_to_ggml(*gpt_oss_to_canonical(blocks, gs)))
    back["ggml -> gpt-oss"] = gpt_oss_to_canonical(*canonical_to_gpt_oss(*ggml_to_canonical(ggml)))
    for name, (p, s) in back.items():
        assert torch.equal(p, packed) and torch.equal(s, scales), name
        assert_same(dequantize(p, s, torch.float64), want)
    assert torch.equal(canonical_to_ggml(*gpt_oss_to_canonical(*canonical_to_gpt_oss(*ggml_to_canonical(ggml)))),
                       ggml)


def test_ggml_layout_by_hand():
    codes = torch.arange(32, dtype=torch.uint8) % 16  # element j holds code j % 16
    packed = codes[0::2] | (codes[1::2] << 4)
    ggml = canonical_to_ggml(packed, torch.tensor([130], dtype=torch.uint8))
    assert ggml[0, 0] == 130
    assert ggml[0, 1:].tolist() == [(j % 16) | ((j + 16) % 16) << 4 for j in range(16)]


@SETTINGS
@given(mxfp4_tensors())
def test_ggml_layout_dequantises_like_gguf_reference(t):
    packed, scales = t
    blocks = canonical_to_ggml(packed, scales)
    with np.errstate(over="ignore"):  # scale bytes 253-255 overflow float32, as ours do
        theirs = torch.from_numpy(gguf_quants.dequantize(blocks.reshape(*scales.shape[:-1], -1).numpy(),
                                                         GGMLQuantizationType.MXFP4))
    ours = dequantize(*ggml_to_canonical(blocks))
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(ours.shape)
    nan_block = (scales == 255).repeat_interleave(32, dim=-1)
    # documented differences: ggml decodes code 8 as +0.0 (OCP: -0.0) and has no NaN scale
    zero = (codes == 8) & ~nan_block
    assert torch.all(ours[zero].view(torch.int32) == torch.tensor(-0.0).view(torch.int32))
    assert torch.all(theirs[zero].view(torch.int32) == 0)
    assert torch.isnan(ours[nan_block]).all() and not torch.isnan(theirs).any()
    keep = (codes != 8) & ~nan_block
    assert torch.equal(ours[keep].view(torch.int32), theirs[keep].view(torch.int32))


@pytest.mark.parametrize("layout", ["canonical", "gpt-oss"])
def test_gate_up_split_and_interleave(layout):
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (2, 6, 64), dtype=torch.uint8, generator=gen)  # [E, 2I, K/2]
    scales = torch.randint(100, 150, (2, 6, 4), dtype=torch.uint8, generator=gen)  # [E, 2I, K/32]
    full = dequantize(packed, scales)
    if layout == "gpt-oss":
        packed, scales = canonical_to_gpt_oss(packed, scales)  # [E, 2I, K/32, 16]
    (gp, gs), (up, us) = split_gate_up_interleaved(packed, scales)
    assert gp.shape[1] == up.shape[1] == 3 and gs.shape == us.shape == (2, 3, 4) and gp.is_contiguous()
    if layout == "gpt-oss":
        (gp, gs), (up, us) = gpt_oss_to_canonical(gp, gs), gpt_oss_to_canonical(up, us)
    assert torch.equal(dequantize(gp, gs), full[:, 0::2]) and torch.equal(dequantize(up, us), full[:, 1::2])
    if layout == "gpt-oss":
        (gp, gs), (up, us) = canonical_to_gpt_oss(gp, gs), canonical_to_gpt_oss(up, us)
    p, s = interleave_gate_up((gp, gs), (up, us))
    assert torch.equal(p, packed) and torch.equal(s, scales)


def test_layout_errors():
    p, s = torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="do not match scales"):
        dequantize(p, s[:, :1])
    with pytest.raises(CheckpointError, match="must be uint8"):
        dequantize(p.int(), s)
    with pytest.raises(CheckpointError, match=r"\[..., K/32, 17\]"):
        ggml_to_canonical(torch.zeros(2, 16, dtype=torch.uint8))
    with pytest.raises(CheckpointError, match="gpt-oss"):
        gpt_oss_to_canonical(torch.zeros(2, 2, 15, dtype=torch.uint8), s)
    with pytest.raises(CheckpointError, match="even number of rows"):
        split_gate_up_interleaved(p[:1], s[:1])
    with pytest.raises(CheckpointError, match="multiple of 32"):
        quantize(torch.zeros(3, 48))
    with pytest.raises(ValueError, match="scale rule"):
        quantize(torch.zeros(32), scale_rule="round")


# ---- dequantise: dtypes ----

@SETTINGS
@given(mxfp4_tensors())
def test_dequantise_dtypes_equal_float32_cast(t):
    packed, scales = t
    f32, f64 = dequantize(packed, scales), dequantize(packed, scales, torch.float64)
    assert_same(f32, f64.to(torch.float32))
    for dtype in (torch.bfloat16, torch.float16):
        assert_same(dequantize(packed, scales, dtype), f32.to(dtype))
    # exact in bf16 (and f32) while the scale is in range: every scale byte up to 252
    in_range = (scales <= 252).repeat_interleave(32, dim=-1)
    assert torch.equal(dequantize(packed, scales, torch.bfloat16)[in_range].double(), f64[in_range])


def test_dequantise_all_scales_and_codes():
    scales = torch.arange(256, dtype=torch.uint8).view(256, 1).expand(256, 16).contiguous()  # [256, 16]
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # [256, 256]: every byte at every scale
    f64 = dequantize(packed, scales, torch.float64)
    assert_same(f64, torch.from_numpy(ref_dequantize(packed.numpy(), scales.numpy())))
    assert_same(dequantize(packed, scales), f64.float())
    assert torch.isnan(f64[255]).all() and not torch.isnan(f64[:255]).any()
    # float32 holds every value up to scale byte 252; 253/254 overflow the large codes only
    assert torch.isfinite(dequantize(packed[:253], scales[:253])).all()
    assert dequantize(packed, scales)[253:255].isinf().any()
    # float16 is exact for scale bytes 104..140
    f16_ok = slice(104, 141)
    assert torch.equal(dequantize(packed[f16_ok], scales[f16_ok], torch.float16).double(), f64[f16_ok])


# ---- quantise ----

def blocks_of(values: list[float], dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values + [0.0] * (32 - len(values)), dtype=dtype)


def test_ties_to_even():
    # with amax = 6 the scale is 2^0 and the grid is the plain E2M1 values
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    for sign in (1.0, -1.0):
        x = blocks_of([6.0] + [sign * v for v in ties])
        packed, scales = quantize(x)
        assert scales.tolist() == [127]
        assert dequantize(packed, scales)[1:8].tolist() == [sign * v for v in want]
    # one ulp either side of each tie goes to the nearer neighbour
    t = torch.tensor(ties)
    below, above = torch.nextafter(t, torch.zeros(7)), torch.nextafter(t, torch.full((7,), 9.0))
    x = torch.cat((torch.tensor([6.0]), below, above, torch.zeros(17)))
    got = dequantize(*quantize(x))[1:15].tolist()
    assert got == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0] + [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_scale_rules_on_the_block_maximum():
    # amax / 2^(floor(log2 amax) - 2) = 7: "midpoint" keeps 2^0 and saturates 7 -> 6;
    # "no_clip" moves to 2^1 (7 / 2 = 3.5 -> 4 -> 8); "ocp" keeps 2^0 for everything below 8,
    # so it clips 3.9 (7.8 * 2^-1) to 3.0 where "midpoint" rounds it to 4
    for amax, rule, scale, value in [(7.0, "midpoint", 127, 6.0), (7.0, "no_clip", 128, 8.0), (7.0, "ocp", 127, 6.0),
                                     (7.5, "midpoint", 128, 8.0), (7.5, "ocp", 127, 6.0), (6.0, "no_clip", 127, 6.0),
                                     (6.5, "no_clip", 128, 6.0), (4.0, "midpoint", 127, 4.0), (3.9, "ocp", 126, 3.0),
                                     (3.9, "midpoint", 127, 4.0)]:
        packed, scales = quantize(blocks_of([amax]), scale_rule=rule)
        assert scales.item() == scale and dequantize(packed, scales)[0].item() == value, (amax, rule)


def test_special_inputs():
    # zero blocks (either sign) -> scale byte 0, zero codes keeping the sign
    packed, scales = quantize(torch.cat((torch.zeros(32), torch.full((32,), -0.0))))
    assert scales.tolist() == [0, 0] and packed[:16].eq(0).all() and packed[16:].eq(0x88).all()
    assert_same(dequantize(packed, scales), torch.cat((torch.zeros(32), torch.full((32,), -0.0))))
    # tiny and subnormal inputs: the scale clamps at 2^-127; values below 2^-129 flush to zero
    tiny = [2.0**-128, 3 * 2.0**-129, 2.0**-130, -(2.0**-131), 1e-45, 6 * 2.0**-127]
    packed, scales = quantize(blocks_of(tiny))
    assert scales.item() == 0
    assert dequantize(packed, scales)[:6].tolist() == [2.0**-128, 2.0**-127, 0.0, -0.0, 0.0, 6 * 2.0**-127]
    packed, scales = quantize(blocks_of([2.0**-140, -(2.0**-149)]))  # natural scale 2^-142: clamped
    assert scales.item() == 0 and dequantize(packed, scales)[:2].tolist() == [0.0, -0.0]
    # NaN or +-Inf anywhere in a block -> scale 0xFF, zero codes, the whole block decodes to NaN
    for bad in (math.nan, math.inf, -math.inf):
        x = torch.cat((blocks_of([1.0, bad, 3.0]), blocks_of([1.0, 6.0])))
        packed, scales = quantize(x)
        assert scales.tolist() == [255, 127] and packed[:16].eq(0).all()
        out = dequantize(packed, scales)
        assert out[:32].isnan().all() and out[32:34].tolist() == [1.0, 6.0]
    # float64 beyond MXFP4's largest scale -> NaN block; just inside -> scale byte 254
    packed, scales = quantize(torch.cat((blocks_of([1e300], torch.float64), blocks_of([1e39], torch.float64))))
    assert scales.tolist() == [255, 254]
    assert dequantize(packed, scales, torch.float64)[32].item() == 6 * 2.0**127
    assert dequantize(packed, scales)[32].item() == math.inf  # beyond float32


finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@st.composite
def float_blocks(draw):
    """float32 `[R, K]` with K = 32 * n: values of every magnitude, scaled per row by 2^k,
    plus ties and grid points so rounding corner cases come up."""
    rows, groups = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    special = st.sampled_from([0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, -7.0,
                               2.0**-149, -(2.0**127)])
    x = draw(hnp.arrays(np.float32, (rows, 32 * groups), elements=st.one_of(finite32, special)))
    shift = draw(hnp.arrays(np.int32, (rows, 1), elements=st.integers(-140, 130)))
    with np.errstate(over="ignore", under="ignore"):
        x = np.ldexp(x, shift).astype(np.float32)
    return torch.from_numpy(np.where(np.isfinite(x), x, 0.0).astype(np.float32))


@pytest.mark.parametrize("rule", sorted(mxfp4.SCALE_RULES))
@SETTINGS
@given(x=float_blocks())
def test_quantise_equals_reference_within_bound(rule, x):
    packed, scales = quantize(x, scale_rule=rule)
    want_p, want_s = ref_quantize(x.double().numpy(), mxfp4.SCALE_RULES[rule])
    assert np.array_equal(scales.numpy(), want_s) and np.array_equal(packed.numpy(), want_p)
    assert torch.equal(quantize(x.double(), scale_rule=rule)[0], packed)  # float64 path agrees
    err = (dequantize(packed, scales, torch.float64) - x.double()).abs()
    amax = x.double().abs().view(-1, 32).amax(dim=-1).repeat_interleave(32).view(x.shape)
    rel, floor = BOUNDS[rule]
    assert torch.all(err <= torch.maximum(torch.maximum(x.double().abs() * rel, amax * floor),
                                          torch.tensor(2.0**-129, dtype=torch.float64)))


@SETTINGS
@given(mxfp4_tensors(), st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_exact_representables_round_trip(t, dtype):
    packed, scales = t
    scales = scales.clamp(max=252 if dtype != torch.float64 else 254)  # finite in dtype
    x = dequantize(packed, scales, dtype)
    assert_same(dequantize(*quantize(x), dtype), x)


def test_input_dtypes_layouts_and_chunks(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 96, generator=gen) * torch.logspace(-3, 3, 5).unsqueeze(-1)
    packed, scales = quantize(x)
    assert packed.shape == (5, 48) and scales.shape == (5, 3)
    monkeypatch.setattr(mxfp4, "_CHUNK_BLOCKS", 2)  # chunk seams inside and across rows
    for y in (x, x.t().contiguous().t(), x.view(5, 3, 32).transpose(0, 1).contiguous().transpose(0, 1)):
        p, s = quantize(y)
        assert torch.equal(p.reshape(5, 48), packed) and torch.equal(s.reshape(5, 3), scales)
    assert torch.equal(dequantize(packed, scales), dequantize(*quantize(x)))
    for dtype in (torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        p, s = quantize(xd)
        want = ref_quantize(xd.double().numpy(), mxfp4.SCALE_RULES[mxfp4.DEFAULT_SCALE_RULE])
        assert np.array_equal(p.numpy(), want[0]) and np.array_equal(s.numpy(), want[1])
    x8 = x.clamp(-400, 400).to(torch.float8_e4m3fn)
    assert all(torch.equal(a, b) for a, b in zip(quantize(x8), quantize(x8.float())))
    empty = quantize(torch.zeros(2, 0))
    assert empty[0].shape == (2, 0) and empty[1].shape == (2, 0)


def test_ocp_rule_matches_ggml_quantiser():
    # gguf's numpy quantiser is the OCP rule with nearest rounding (ties towards the smaller
    # code; random data has none) and +0 for negatives that round to zero
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((8, 256)) * rng.uniform(1e-3, 1e3, (8, 1))).astype(np.float32)
    x[0, :32] = 0.0
    theirs = ggml_to_canonical(torch.from_numpy(gguf_quants.quantize(x, GGMLQuantizationType.MXFP4)).view(8, 8, 17))
    packed, scales = quantize(torch.from_numpy(x), scale_rule="ocp")

    def zero_sign(p: torch.Tensor) -> torch.Tensor:  # code 8 (-0) -> code 0 in both nibbles
        return torch.where((p & 0xF) == 8, p & 0xF0, p) & torch.where((p >> 4) == 8, 0x0F, 0xFF)

    assert torch.equal(scales, theirs[1]) and torch.equal(zero_sign(packed), zero_sign(theirs[0]))


def test_quantization_error_report(monkeypatch):
    x = torch.tensor([[1.0, 1.2, -5.0, 6.0] + [0.0] * 28])
    report = quantization_error(x, *quantize(x))
    err = torch.tensor([0.0, 0.2, 1.0, 0.0], dtype=torch.float64)  # 1.2 -> 1.0, -5 -> -4
    rms_x = math.sqrt((1 + 1.2**2 + 25 + 36) / 32)
    assert report["max_abs"] == 1.0
    assert report["rmse"] == pytest.approx(math.sqrt(err.square().sum().item() / 32))
    assert report["relative_rmse"] == pytest.approx(report["rmse"] / rms_x)
    monkeypatch.setattr(mxfp4, "_CHUNK_BLOCKS", 3)
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(7, 64, generator=gen)
    got = quantization_error(y, *quantize(y))
    d = dequantize(*quantize(y), torch.float64) - y.double()
    assert got["rmse"] == pytest.approx(d.square().mean().sqrt().item(), rel=1e-12)
    assert got["max_abs"] == d.abs().max().item()
    assert quantization_error(torch.zeros(1, 32), *quantize(torch.zeros(1, 32)))["relative_rmse"] == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_equals_cpu():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 4096, generator=gen) * torch.logspace(-30, 30, 64).unsqueeze(-1)
    x[3, 5], x[4, 7] = math.nan, math.inf
    packed, scales = quantize(x)
    p, s = quantize(x.cuda())
    assert torch.equal(p.cpu(), packed) and torch.equal(s.cpu(), scales)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        assert_same(dequantize(p, s, dtype).cpu(), dequantize(packed, scales, dtype))
    assert torch.equal(canonical_to_ggml(p, s).cpu(), canonical_to_ggml(packed, scales))
