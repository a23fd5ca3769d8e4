"""MoE GGUFs in llama.cpp's layout (`localmoe.testing.moe_gguf`: its architecture names, metadata keys,
tensor names, stacked `*_exps` experts, block types mixed per tensor as llama-quantize's Q4_K_M mixes
them) against the same weights in the HF layout, dequantised by the `gguf` package's own numpy
dequantisers: resident, from a converted store, and paged at 25% RAM."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from localmoe.config import EngineConfig, PagingConfig
from localmoe.engine.quantized import BlockQuantized
from localmoe.errors import CheckpointError
from localmoe.load import load_model
from localmoe.store.gguf import GGUFFile
from localmoe.testing import write_checkpoint
from localmoe.testing.moe_gguf import write_dequantized, write_moe_gguf
from localmoe.testing.moe_gguf_parts import IQ_DYNAMIC

PROMPT = torch.tensor([[5, 17, 3, 99, 42, 7, 250, 11]])
# every architecture in F32, BF16, Q8_0 and llama-quantize's Q4_K_M mix (the 64-wide tiny models take its fallback
# types Q5_0 / Q8_0 for rows too narrow for 256-value blocks); the IQ4 types and the "iq_dynamic" mix (routed
# experts in IQ1_S ... IQ3_S, Q2_K, Q3_K per tensor) on the 256-wide ones, where the IQ blocks fit
MIXED = [(f, "q4_k_m") for f in ("qwen3_moe", "deepseek_v32", "deepseek_v3", "kimi_linear", "qwen3_next", "glm4_moe",
                                  "kimi_k3", "glm5_next", "glm_moe_dsa")] + [("qwen3_moe", "iq_dynamic"), ("glm4_moe", "iq_dynamic")] + \
        [(f, "mxfp4_moe") for f in ("qwen3_moe", "deepseek_v32")]  # llama-quantize's MXFP4_MOE: experts MXFP4, the rest Q8_0
CASES = [("qwen3_moe", t) for t in ("f32", "bf16", "q8_0", "iq4_xs", "iq4_nl")] + \
        [("deepseek_v32", t) for t in ("f32", "bf16", "q8_0")] + [("glm_moe_dsa", t) for t in ("f32", "bf16", "q8_0")] + \
        [("deepseek_v3", t) for t in ("f32", "q8_0")] + \
        [("kimi_linear", t) for t in ("f32", "bf16", "q8_0")] + [("qwen3_next", t) for t in ("f32", "bf16", "q8_0")] + \
        [("glm4_moe", t) for t in ("f32", "bf16", "q8_0")] + \
        [("kimi_k3", t) for t in ("f32", "bf16", "q8_0")] + [("glm5_next", t) for t in ("f32", "bf16", "q8_0")] + MIXED  # K3: experts MXFP4 in every file, as llama.cpp writes them
FAMILIES = sorted({family for family, _ in CASES})


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_gguf")
    return {family: write_checkpoint(family, root / family, size="tiny", seed=3) for family in FAMILIES}


@pytest.fixture(scope="module")
def pair(source, tmp_path_factory):
    """(GGUF, its dequantised HF twin) per (family, types), written once."""
    cache = {}

    def get(family: str, types: str):
        if (family, types) not in cache:
            root = tmp_path_factory.mktemp(f"{family}_{types}")
            gguf = write_moe_gguf(source[family], root / f"{family}.{types}.gguf", types)
            cache[family, types] = gguf, write_dequantized(source[family], gguf, root / "dequantized")
        return cache[family, types]

    return get


def _run(model, steps: int = 6) -> list[torch.Tensor]:
    """Prefill logits, then greedy decode steps' logits."""
    cache = model.new_cache(1, PROMPT.shape[1] + steps + 1)
    out = [model.forward(PROMPT, cache, all_logits=True)]
    for _ in range(steps):
        out.append(model.forward(out[-1][:, -1:].argmax(-1), cache))
    return out


def _load(path, **kw):
    return load_model(path, EngineConfig(dtype="float32", expert_precision="exact", **kw), progress=False)


@pytest.mark.parametrize(("family", "types"), CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_gguf_matches_its_dequantised_hf_twin(pair, source, family, types):
    """Same spec from the metadata as from config.json, same tokenizer, and prefill + cached decode
    within 1e-5 of the logit range (our block decoders equal gguf's, so the fp32 weights are the same
    numbers; measured: bit-identical for qwen3moe, 1.2e-7 for deepseek32, whose twin's F32 matrices take
    other CPU GEMM paths than the GGUF's views). Unquantised types also equal the bf16 source exactly."""
    gguf, twin = pair(family, types)
    ours, ref = _load(gguf), _load(twin)
    assert dataclasses.replace(ours.spec, name="") == ref.spec
    kinds = {GGUFFile(gguf).info(n).ggml_type for n in GGUFFile(gguf).tensor_names()}
    if types == "q4_k_m":  # mixed per tensor
        assert ({Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.F32} if ours.spec.hidden_size % 256 == 0 else
                {Q.Q5_0, Q.Q8_0, Q.F32}) <= kinds
    if types == "iq_dynamic":
        assert {Q[t] for t in IQ_DYNAMIC[3 * min(ours.spec.moe_layers()):]} <= kinds
    for step, (a, b) in enumerate(zip(_run(ours.model), _run(ref.model))):
        diff = (a - b).abs().max().item()
        assert diff <= 1e-5 * (b.max() - b.min()).item(), f"step {step}: max diff {diff:.3e}"
    if types in ("f32", "bf16"):
        for step, (a, b) in enumerate(zip(_run(ours.model), _run(_load(source[family]).model))):
            assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item():.3e}"
    text = "The capital of France is Paris, 2026."
    assert ours.tokenizer.encode(text) == ref.tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.chat_prompt(messages) == ref.chat_prompt(messages)  # the template came from the GGUF


def test_block_experts_stay_blocks_and_q8_follows_the_gemv_reference(pair):
    """Resident K-quant experts are BlockQuantized views of the file (no float copy); at expert precision
    q8 one expert's projections equal the ggml GEMV reference (x rounded to int8, llama.cpp's trade), and the
    model's logits stay within 0.5% of the range of the exact ones."""
    from localmoe.kernels.ggml_gemv import naive_ggml_gemv

    gguf, _ = pair("qwen3_moe", "q4_k_m")
    exact, q8 = _load(gguf), load_model(gguf, dtype="float32", expert_precision="q8", progress=False)
    w = q8.model.moe_blocks()[2].experts.get(2, 5)
    assert isinstance(w.gate.weight, BlockQuantized) and w.down.weight.ggml_type == Q.Q6_K  # layer 2: more bits
    x = torch.randn(3, w.gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
    for proj in (w.gate, w.up):
        want = naive_ggml_gemv(x, proj.weight.raw, proj.weight.ggml_type, proj.weight.shape)
        torch.testing.assert_close(proj(x, "q8"), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.gate(x), x @ w.gate.dense().T, rtol=0, atol=0)  # exact: dequantised fp32
    a, b = _run(q8.model, 0)[0], _run(exact.model, 0)[0]
    assert (a - b).abs().max() <= 5e-3 * (b.max() - b.min())


@pytest.mark.parametrize(("family", "types"), MIXED, ids=[f"{f}-{t}" for f, t in MIXED])
def test_mixed_store_resident_and_paged(pair, tmp_path, family, types):
    """Every architecture's mixed file converted to a store (each expert's blocks kept per tensor type, K3's MXFP4
    repacked): paged at a quarter of the experts in RAM == the store resident, bit for bit, and both give the
    GGUF's logits: bit for bit, except glm5-next's decode steps (about 1e-7 of the range: the GGUF's F32 tensors
    are views of the file at 32-byte alignment, which sends some CPU GEMVs down other paths; the HF directory and
    its store agree bit for bit)."""
    from localmoe.convert import convert
    from localmoe.paging import Pager, expert_bytes
    from localmoe.store.packed import PackedStore

    gguf, _ = pair(family, types)
    resident = _load(gguf)
    want = _run(resident.model)
    convert(gguf, tmp_path / "store", progress=False)
    store = PackedStore(tmp_path / "store")
    assert store.layers() == list(resident.spec.moe_layers())
    runs = []
    for budget in (0, expert_bytes(store) // 4):
        ours = _load(tmp_path / "store", paging=PagingConfig(ram_budget=budget))
        assert isinstance(ours.model.moe_blocks()[0].experts, Pager) == (budget != 0)
        runs.append(_run(ours.model))
    for step, (a, b, c) in enumerate(zip(*runs, want)):
        assert torch.equal(a, b), f"paged, step {step}: max diff {(a - b).abs().max().item():.3e}"
        if family == "glm5_next":
            rel = ((a - c).abs().max() / (c.max() - c.min())).item()
            assert rel <= 1e-6, f"step {step}: {rel:.2e} of the range"
        else:
            assert torch.equal(a, c), f"store, step {step}: max diff {(a - c).abs().max().item():.3e}"


def test_repacked_at_load_gives_the_bits_of_the_gguf_layout(pair, tmp_path, monkeypatch):
    """At dtype auto and expert precision q8 (what benchmarks/gguf_moe.py runs) the loader repacks the Q4_K and Q6_K
    matrices and experts it keeps resident and the Q6_K lm_head, which reads int8 inputs there (Q4_K_R8, Q6_K_R8,
    kernels/ggml_gemv/repacked.py); prefill and the fused decode step give the bits of the same file with the GGUF
    layout kept, and of its converted store paged at a quarter of the experts (the pager reads the store's GGUF
    layout)."""
    import localmoe.load as load
    from localmoe.convert import convert
    from localmoe.kernels.ggml_gemv.repacked import Q4_K_R8, Q6_K_R8
    from localmoe.paging import Pager, expert_bytes
    from localmoe.store.packed import PackedStore

    gguf, _ = pair("qwen3_moe", "q4_k_m")
    auto = {"dtype": "auto", "expert_precision": "q8", "progress": False}
    repacked = load_model(gguf, **auto)
    assert repacked.model.moe_blocks()[0].experts.get(0, 1).gate.weight.ggml_type == Q4_K_R8
    assert repacked.model.lm_head.ggml_type == Q6_K_R8
    assert Q6_K_R8 in {b.experts.get(i, 1).down.weight.ggml_type for i, b in enumerate(repacked.model.moe_blocks())}
    want = _run(repacked.model)
    assert repacked.model._plan is not None  # the fused decode step ran
    convert(gguf, tmp_path / "store", progress=False)
    paged = load_model(tmp_path / "store", paging=PagingConfig(ram_budget=expert_bytes(PackedStore(tmp_path / "store"))
                                                               // 4), **auto)
    assert isinstance(paged.model.moe_blocks()[0].experts, Pager)
    monkeypatch.setattr(load, "repack_blocks", lambda weights, **heads: weights)
    plain = load_model(gguf, **auto)
    assert plain.model.moe_blocks()[0].experts.get(0, 1).gate.weight.ggml_type == Q.Q4_K
    assert plain.model.lm_head.ggml_type == Q.Q6_K
    for step, (a, b, c) in enumerate(zip(want, _run(plain.model), _run(paged.model))):
        assert torch.equal(a, b), f"GGUF layout, step {step}: max diff {(a - b).abs().max().item():.3e}"
        assert torch.equal(a, c), f"paged, step {step}: max diff {(a - c).abs().max().item():.3e}"


def test_fused_step_reads_a_block_embedding_row_in_one_call(pair):
    """The fused decode step of a Q4_K_M file looks its Q4_K embedding row up through ggml_gemv.row_reader (one
    library call into a kept buffer): the row's values are the embedding's, and decode gives the bits of the general
    lookup (BlockEmbedding[token], then copied)."""
    import ctypes

    gguf, _ = pair("qwen3_moe", "q4_k_m")
    model = load_model(gguf, dtype="auto", expert_precision="q8", progress=False).model
    want = _run(model)
    plan = model.decode_plan()
    assert plan is not None and plan.embed_rows is not None and model.embed.weight.ggml_type == Q.Q4_K
    read, rows = plan.embed_rows
    D = model.spec.hidden_size
    for token in (0, 17, rows - 1):
        got = torch.frombuffer(bytearray((ctypes.c_float * D).from_address(read(token))), dtype=torch.float32)
        assert torch.equal(got, model.embed[token])
    with pytest.raises(IndexError, match="outside the embedding"):
        plan.run(torch.tensor([[rows]]), model.new_cache(1, 4))
    plan.embed_rows = None  # the general lookup
    for step, (a, b) in enumerate(zip(_run(model), want)):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item():.3e}"


@pytest.fixture(scope="module")
def q4_k_m_store(pair, tmp_path_factory):
    """(store, routing trace, the GGUF's logits) of qwen3_moe's Q4_K_M file at what benchmarks/gguf_moe.py runs: dtype
    auto, expert precision q8 (the resident file repacked, the store in the GGUF layout)."""
    from localmoe.convert import convert
    from localmoe.paging import attach, detach
    from localmoe.paging.trace import RoutingTrace

    gguf, _ = pair("qwen3_moe", "q4_k_m")
    root = tmp_path_factory.mktemp("q4_k_m_store")
    convert(gguf, root / "store", progress=False)
    resident = load_model(gguf, dtype="auto", expert_precision="q8", progress=False).model
    want = _run(resident)
    trace = RoutingTrace()
    attach(resident, trace=trace)  # the routing the Belady oracle sees
    _run(resident)
    detach(resident)
    trace.save(root / "trace.json")
    return root / "store", str(root / "trace.json"), want


@pytest.mark.parametrize("io", ["odirect", "mmap"])
@pytest.mark.parametrize(("policy", "prefetch"), [("lru", False), ("lru", True), ("lfu", True), ("lfru", True),
                                                  ("belady", True)], ids=lambda v: str(v))
def test_block_store_pages_under_every_policy(q4_k_m_store, policy, prefetch, io):
    """A store of llama-quantize's K-quant blocks pages under --ram as MXFP4 stores do: every policy, either I/O
    backend, prefetch on and off, a quarter of the experts in RAM; paged == the GGUF resident, bit for bit."""
    from localmoe.paging import Pager, expert_bytes
    from localmoe.store.packed import PackedStore

    store, trace, want = q4_k_m_store
    paging = PagingConfig(ram_budget=expert_bytes(PackedStore(store)) // 4, policy=policy, io=io, prefetch=prefetch,
                          trace=trace if policy == "belady" else "")
    paged = load_model(store, dtype="auto", expert_precision="q8", paging=paging, progress=False).model
    pager = paged.moe_blocks()[0].experts
    assert isinstance(pager, Pager)
    for step, (a, b) in enumerate(zip(_run(paged), want)):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item():.3e}"
    assert pager.stats.ram.misses > 0 and (pager.stats.prefetch.issued > 0) == prefetch  # it paged, and prefetched


def test_converted_store_keeps_the_blocks_per_tensor_type(pair, tmp_path):
    """`localmoe convert x.gguf store` keeps each expert's blocks as extent parts in the type of its tensor
    (`down.q6_k` where llama-quantize gave layer 2 more bits; one IQ type per tensor in the dynamic mix), lossless
    (the logits: test_mixed_store_resident_and_paged)."""
    from localmoe.convert import convert
    from localmoe.store.packed import PackedStore

    for types, parts in (("q4_k_m", {0: ("q4_k", "q4_k", "q4_k"), 2: ("q4_k", "q4_k", "q6_k")}),
                         ("iq_dynamic", {i: IQ_DYNAMIC[3 * i:3 * i + 3] for i in range(3)})):
        gguf, _ = pair("qwen3_moe", types)
        report = convert(gguf, tmp_path / types, progress=False).report
        assert report["experts"]["stored"] == "ggml-blocks-kept" and report["experts"]["lossless"]
        store = PackedStore(tmp_path / types)
        for layer, kinds in parts.items():
            assert [p.name for p in store.layout(layer).parts] == [f"{p}.{k.lower()}" for p, k in
                                                                   zip(("gate", "up", "down"), kinds)]


@pytest.mark.parametrize("types", ["q4_k_m", "iq_dynamic"])
def test_inspect_and_plan_report_bytes_per_type(pair, source, tmp_path, types):
    """`localmoe inspect` and `localmoe plan` of a mixed GGUF and of its store: bytes per ggml type (the store
    names its experts' blocks from the part suffix), per type equal to the sum gguf's own reader gives; and the HF
    checkpoint's parameter counts, total and active."""
    import gguf as g
    from click.testing import CliRunner

    from localmoe.cli import cli
    from localmoe.convert import convert
    from localmoe.describe import describe_model, format_type_bytes

    path, _ = pair("qwen3_moe", types)
    convert(path, tmp_path / "store", progress=False)
    want = describe_model(source["qwen3_moe"])
    by_reader: dict[str, int] = {}
    for t in g.GGUFReader(path).tensors:
        by_reader[t.tensor_type.name] = by_reader.get(t.tensor_type.name, 0) + int(t.n_bytes)
    kinds = {"Q4_K", "Q5_K", "Q6_K", "Q8_0", "F32"} | (set(IQ_DYNAMIC) if types == "iq_dynamic" else set())
    assert set(by_reader) == kinds
    runner = CliRunner()
    for where in (path, tmp_path / "store"):
        d = describe_model(where)
        assert (d["parameters_total"], d["parameters_active"]) == (want["parameters_total"], want["parameters_active"])
        assert {k: v["bytes"] for k, v in d["tensor_dtypes"].items()} == by_reader
        for command in ("inspect", "plan"):
            out = runner.invoke(cli, [command, str(where)])
            assert out.exit_code == 0, out.output
            assert format_type_bytes(d["tensor_dtypes"]) in out.output


def test_split_dynamic_quant_equals_its_unsplit_file(pair, tmp_path):
    """The IQ-mixed file split in 3 parts (as the big dynamic quants ship): any part runs with the unsplit file's
    bits, and its converted store holds the same expert extents."""
    from localmoe.convert import convert
    from localmoe.store.packed import PackedStore
    from localmoe.testing.gguf_split import split_gguf

    whole, _ = pair("qwen3_moe", "iq_dynamic")
    (tmp_path / "split").mkdir()
    parts = split_gguf(whole, tmp_path / "split" / "q.gguf", 3)
    for step, (a, b) in enumerate(zip(_run(_load(parts[1]).model), _run(_load(whole).model))):
        assert torch.equal(a, b), f"step {step}"
    convert(parts[2], tmp_path / "from_split", progress=False)
    convert(whole, tmp_path / "from_whole", progress=False)
    a, b = PackedStore(tmp_path / "from_split"), PackedStore(tmp_path / "from_whole")
    for layer in a.layers():
        for e in (0, 7):
            x, y = a.expert(layer, e), b.expert(layer, e)
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_float_experts_keep_converts_exactly(pair, tmp_path):
    from localmoe.convert import convert

    gguf, twin = pair("qwen3_moe", "f32")
    convert(gguf, tmp_path / "store", experts="keep", progress=False)
    for a, b in zip(_run(_load(tmp_path / "store").model), _run(_load(twin).model)):
        assert torch.equal(a, b)


def test_missing_expert_tensor_is_named(source, tmp_path):
    from localmoe.testing.gguf_split import rewrite_gguf

    path = write_moe_gguf(source["qwen3_moe"], tmp_path / "ok.gguf", "q8_0")
    rewrite_gguf(path, tmp_path / "broken.gguf", omit=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(CheckpointError, match=r"broken\.gguf: tensor 'layers\.1\.mlp\.experts\.0\.up\.weight' is "
                                              r"missing"):
        load_model(tmp_path / "broken.gguf", dtype="float32", progress=False)


def test_k3_store_repacks_mxfp4_experts(pair, source, tmp_path):
    """K3's Q8_0 GGUF converted to a store: its stacked ggml MXFP4 experts become the canonical MXFP4 parts,
    byte for byte those of the store converted from the HF checkpoint (the same codes and scales); the store
    gives the GGUF's bits (paged: test_mixed_store_resident_and_paged)."""
    from localmoe.convert import convert
    from localmoe.store.packed import PackedStore

    gguf, _ = pair("kimi_k3", "q8_0")
    report = convert(gguf, tmp_path / "store", progress=False).report
    assert report["experts"]["lossless"]
    convert(source["kimi_k3"], tmp_path / "hf_store", progress=False)
    store, hf_store = PackedStore(tmp_path / "store"), PackedStore(tmp_path / "hf_store")
    assert store.layers() == hf_store.layers() == list(range(1, 7))
    assert [p.name for p in store.layout(1).parts] == [f"{p}.{k}" for p in ("gate", "up", "down")
                                                       for k in ("packed", "scales")]
    for layer, e in ((1, 0), (4, 15), (6, 7)):
        ours, theirs = store.expert(layer, e), hf_store.expert(layer, e)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    ours = _load(tmp_path / "store")
    for step, (a, b) in enumerate(zip(_run(ours.model), _run(_load(gguf).model))):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item():.3e}"


def _rewrite_experts(src, dst, experts):
    """GGUF `src` again at `dst`, metadata and tensors unchanged but the stacked `*_exps` ones: `experts(name,
    float32 values)` -> (stored array, ggml type) for each."""
    import gguf as g
    import numpy as np

    reader = g.GGUFReader(src)
    writer = g.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub = field.types[-1] if field.types[0] == g.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        if t.name.endswith("_exps.weight"):
            values = g.quants.dequantize(np.ascontiguousarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)
            data, kind = experts(t.name, values)
        else:
            data, kind = np.ascontiguousarray(t.data), t.tensor_type
        writer.add_tensor(t.name, data, raw_shape=None if data.dtype == np.uint8 else shape,
                          raw_dtype=None if kind == Q.F32 else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_k3_requantised_experts_run_from_their_blocks(pair, tmp_path):
    """A K3 GGUF whose MXFP4 experts a community quant requantised (gate / up Q5_0, down IQ4_NL; Q8_0 in a second
    file: the tiny K3's 32-wide latent experts take 32-value blocks only) runs from those blocks: its logits within 1e-5 of the range of the same file with the experts as F32
    values decoded by gguf's own dequantiser; converted to a store, paged at a quarter of the experts == resident,
    bit for bit."""
    import numpy as np

    from localmoe.convert import convert
    from localmoe.paging import Pager, expert_bytes
    from localmoe.store.packed import PackedStore
    from localmoe.testing.moe_gguf_parts import _encode

    src, _ = pair("kimi_k3", "f32")
    rng = np.random.default_rng(0)
    for kinds in ((Q.Q5_0, Q.Q5_0, Q.IQ4_NL), (Q.Q8_0,) * 3):
        def requantise(name, values, kinds=kinds):
            kind = kinds[("gate", "up", "down").index(name.split(".")[2][4:-5])]
            return _encode(values, kind, rng), kind

        root = tmp_path / kinds[0].name
        root.mkdir()
        blocks = _rewrite_experts(src, root / "blocks.gguf", requantise)
        floats = _rewrite_experts(blocks, root / "floats.gguf", lambda name, values: (values, Q.F32))
        ours = _load(blocks)
        w = ours.model.moe_blocks()[0].experts.get(1, 3)
        assert isinstance(w.gate.weight, BlockQuantized) and w.down.weight.ggml_type == kinds[2]
        want = _run(_load(floats).model)
        got = _run(ours.model)
        for step, (a, b) in enumerate(zip(got, want)):
            diff = (a - b).abs().max().item()
            assert diff <= 1e-5 * (b.max() - b.min()).item(), f"{kinds[0].name} step {step}: max diff {diff:.3e}"
        convert(blocks, root / "store", progress=False)
        budget = expert_bytes(PackedStore(root / "store")) // 4
        paged = _load(root / "store", paging=PagingConfig(ram_budget=budget))
        assert isinstance(paged.model.moe_blocks()[0].experts, Pager)
        for step, (a, b) in enumerate(zip(_run(paged.model), got)):
            assert torch.equal(a, b), f"{kinds[0].name} paged, step {step}: max diff {(a - b).abs().max().item():.3e}"


def test_models_doc_lists_every_gguf_architecture_and_type():
    """docs/models.md (issue 24): every GGUF architecture the registry reads is named (the MoE ones in the MoE GGUF
    table, the dense ones in the family table), and every ggml type the gguf package knows sits in its type table,
    in the refused row exactly where localmoe has no dequantiser."""
    import re
    from pathlib import Path

    from localmoe.models import supported_gguf_architectures
    from localmoe.quant.ggml import SUPPORTED_TYPES

    doc = (Path(__file__).parents[2] / "docs" / "models.md").read_text()
    for arch in supported_gguf_architectures():
        assert f"`{arch}`" in doc or re.search(rf"GGUF [\w/]*\b{re.escape(arch)}\b", doc), arch
    start = doc.index("| ggml type | routed experts")
    rows = [line.split("|")[1:3] for line in doc[start:doc.index("\n\n", start)].splitlines()[2:]]
    listed = {name: "refused" in what for types, what in rows for name in re.findall(r"\b[A-Z][A-Z0-9_]*\d[A-Z0-9_]*\b", types)}
    assert set(listed) == {t.name for t in Q}
    assert {name for name, refused in listed.items() if refused} == {t.name for t in Q if t not in SUPPORTED_TYPES}
