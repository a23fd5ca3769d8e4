"""MTP / next-n layers (engine/nextn.py) and the MTP drafter (engine/spec/mtp.py) on the tiny DeepSeek-V3.2
(an MTP layer appended by localmoe.testing.mtp) and GLM-4.5 (generated with one) checkpoints:

- the layer's logits against a float64 re-derivation of DeepSeek-V3's MTP formula, whose decoder layer is
  transformers' own (transformers runs no MTP layer: its DeepSeek and GLM classes skip those tensors);
- greedy decoding with `--spec mtp` equals greedy decoding without, token for token, resident and from a
  packed store (whose converter keeps the MTP layer: its routed experts as extents, paged like any layer's at
  25% with the layer's logits bit for bit the resident ones), and from a GLM-4.5 GGUF (its `nextn` block);
- the drafter's cache after many verify steps (rejected drafts rolled back, chained entries trimmed) gives
  the draft distribution a fresh drafter gives after one prefill of the same history.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from localmoe.config import EngineConfig
from localmoe.engine.generate import Decoder
from localmoe.engine.sampler import SamplingParams
from localmoe.engine.spec.mtp import MTPDrafter
from localmoe.engine.spec.speculator import Speculator
from localmoe.load import load_model, load_nextn
from localmoe.testing.mtp import add_mtp_layer
from localmoe.testing.parity import copy_with_config, earliest_ties, random_tokens
from localmoe.testing.write import write_checkpoint

from .test_speculative import GREEDY, prompt_for, run

FAMILIES = ["deepseek_v32", "glm4_moe"]
CONFIG = EngineConfig(dtype="float32", threads=1, expert_precision="exact")


def _checkpoint(family: str, directory):
    path = write_checkpoint(family, directory / "src", "tiny", seed=0)
    return add_mtp_layer(path) if family == "deepseek_v32" else path


@pytest.fixture(scope="module", params=FAMILIES, ids=FAMILIES)
def checkpoint(request, tmp_path_factory):
    return _checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_layer(checkpoint, tmp_path, transformers):
    """transformers' model of one decoder layer: the MTP layer's tensors as layer 0, its final norm
    `shared_head.norm` and its head `shared_head.head` (the model's lm_head where it has none), float64."""
    from safetensors.torch import load_file, save_file

    config = json.loads((checkpoint / "config.json").read_text())
    L = config["num_hidden_layers"]
    tensors = load_file(checkpoint / "model.safetensors")
    p = f"model.layers.{L}."
    mine = {"model.layers.0." + n[len(p):]: t for n, t in tensors.items() if n.startswith(p)
            and not n[len(p):].startswith(("eh_proj", "enorm", "hnorm", "shared_head", "embed_tokens"))}
    mine |= {"model.embed_tokens.weight": tensors["model.embed_tokens.weight"],
             "model.norm.weight": tensors[p + "shared_head.norm.weight"],
             "lm_head.weight": tensors.get(p + "shared_head.head.weight", tensors["lm_head.weight"])}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
    save_file(mine, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config.update(num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64,
                                                                 attn_implementation="eager", experts_implementation="eager").eval(), tensors, p


def test_mtp_logits_match_a_float64_rederivation(checkpoint, tmp_path):
    """logits_i = head(shared_head.norm(layer(eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])))), h_i the model's
    final-norm hidden state (transformers' last_hidden_state), every position of a 24-token sequence."""
    transformers = pytest.importorskip("transformers")
    ref_layer, tensors, p = _reference_layer(checkpoint, tmp_path, transformers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_model = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager").eval()
    ours = load_model(checkpoint, CONFIG, progress=False)
    eps = ours.spec.rms_norm_eps
    ids = random_tokens(24, 3, ours.spec.vocab_size)
    with torch.no_grad(), earliest_ties():  # DSA: transformers' indexer topk with the engine's tie rule
        h = ref_model.model(ids).last_hidden_state[0]  # [T, D] after the final norm
        w = {n: tensors[p + n + ".weight"].double() for n in ("enorm", "hnorm", "eh_proj")}
        e = tensors["model.embed_tokens.weight"].double()[ids[0, 1:]]
        x = torch.cat([_rms(e, w["enorm"], eps), _rms(h[:-1], w["hnorm"], eps)], -1) @ w["eh_proj"].T
        expected = ref_layer(inputs_embeds=x[None]).logits[0]  # [T - 1, V]

    seen = []
    cache = ours.model.new_cache(1, 32)
    cache.hidden_sink = lambda start, tokens, hidden, settled: seen.append(hidden.clone())
    ours.model.forward(ids, cache)
    head = load_nextn(ours)
    got, _ = head.forward(ids[0, 1:], seen[0][:-1], head.new_cache(32))
    err = (got.double() - expected).abs().max().item() / expected.abs().max().item()
    assert err < 1e-4, f"MTP logits differ from the float64 reference by {err:.2e} of the largest"
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.fixture(scope="module")
def models(checkpoint, tmp_path_factory):
    """(resident, packed store) of the checkpoint."""
    from localmoe.convert import convert

    store = tmp_path_factory.mktemp("store") / "model.lmoe"
    convert(checkpoint, store, experts="keep")
    return load_model(checkpoint, CONFIG, progress=False), load_model(store, CONFIG, progress=False)


@pytest.mark.parametrize("where", ["resident", "store"])
def test_mtp_greedy_equals_plain(models, where):
    loaded = models[where == "store"]
    model = loaded.model
    prompt = prompt_for(model)
    want, _ = run(model, prompt)
    spec = Speculator(MTPDrafter(load_nextn(loaded)), k=3, adaptive=False)
    got, dec = run(model, prompt, speculator=spec)
    assert got == want
    assert spec.stats.drafted > 0, "the MTP drafter never drafted: no verify was exercised"
    assert dec.speculator.drafter.cache.offset == len(dec.in_cache) - 1 - len(dec.ahead) or dec.ahead


def _paged(store, share: int = 4):
    """The store loaded with a pager over 1/`share` of its expert bytes (the MTP layer's included)."""
    from localmoe.config import PagingConfig
    from localmoe.paging import expert_bytes
    from localmoe.store.packed import PackedStore

    with PackedStore(store) as packed:
        slot = max(packed.layout(layer).slot_bytes for layer in packed.layers())
        budget = max(1, expert_bytes(packed) // share // slot) * slot
    config = EngineConfig(dtype="float32", threads=1, expert_precision="exact",
                          paging=PagingConfig(ram_budget=budget, policy="lfru", io="odirect", timeout=10))
    return load_model(store, config, progress=False)


def test_the_store_keeps_the_mtp_experts_as_extents_and_pages_them(models):
    """`convert` writes the MTP layer's routed experts as extents of layer num_layers (not dense); `--spec mtp`
    over a store paged at 25% reads them through the model's pager (its routing told to the pager as any
    layer's), and the layer's logits equal the resident checkpoint's bit for bit; greedy decoding with the
    paged MTP drafter equals plain greedy decoding, paged and resident."""
    from localmoe.paging import Pager
    from localmoe.paging.hooks import PagedRouter
    from localmoe.store.packed import PackedStore

    resident, stored = models
    L = resident.spec.num_layers
    with PackedStore(stored.source) as packed:
        assert L in packed.layers() and len(packed.experts_in(L)) == resident.spec.num_experts
        assert not [n for n in packed.dense_names() if f"layers.{L}.mlp.experts." in n]
        assert not packed.verify()
    paged = _paged(stored.source)
    head, reference = load_nextn(paged), load_nextn(resident)
    pager = head.mlp.experts
    assert isinstance(pager, Pager) and isinstance(head.mlp.router, PagedRouter)
    tokens, hidden = random_tokens(12, 4, resident.spec.vocab_size)[0], torch.randn(12, resident.spec.hidden_size)
    for T in (12, 1):
        got = head.forward(tokens[:T], hidden[:T], head.new_cache(16))[0]
        want = reference.forward(tokens[:T], hidden[:T], reference.new_cache(16))[0]
        assert torch.equal(got, want), f"paged MTP logits differ from resident ones at T={T}"
    assert any(layer == L for layer, _ in pager.where), "the MTP layer's experts never went through the pager"
    prompt = prompt_for(paged.model)
    want, _ = run(resident.model, prompt)
    assert run(paged.model, prompt)[0] == want
    spec = Speculator(MTPDrafter(head), k=3, adaptive=False)
    assert run(paged.model, prompt, speculator=spec)[0] == want
    assert spec.stats.drafted > 0
    pager.close()


class Recording:
    """An MTPDrafter that keeps each history it drafted for and its first draft's distribution."""

    def __init__(self, drafter: MTPDrafter):
        self.inner, self.name, self.seen = drafter, "mtp", []

    def watch(self, cache):
        self.inner.watch(cache)

    def propose(self, history, k, params, generator):
        draft = self.inner.propose(history, k, params, generator)
        if draft.tokens:
            self.seen.append((list(history), draft.q[0].clone()))
        return draft


def test_the_mtp_cache_rolls_back_to_what_a_prefill_gives(checkpoint, tmp_path):
    """After many verify steps (rejected drafts, chained entries trimmed), the first draft's distribution
    equals that of a fresh drafter whose cache was filled by one prefill of the same history. (DeepSeek-V3.2
    with `index_topk` above the positions: with 4, a prefill and decode steps round the indexer's scores
    differently and may select other keys at near-ties, 4.5% of the largest probability apart even without
    any rollback.)"""
    if json.loads((checkpoint / "config.json").read_text()).get("index_topk"):
        checkpoint = copy_with_config(checkpoint, tmp_path / "all", lambda c: c.update(index_topk=128))
    loaded = load_model(checkpoint, CONFIG, progress=False)
    head = load_nextn(loaded)
    params = SamplingParams(temperature=1.0, seed=5)
    prompt = prompt_for(loaded.model)
    live = Recording(MTPDrafter(head))
    run(loaded.model, prompt, steps=24, speculator=Speculator(live, k=3, adaptive=False), params=params)
    assert len(live.seen) >= 3
    for history, q in live.seen[-3:]:
        fresh = MTPDrafter(head)
        dec = Decoder(loaded.model, history[:-1], GREEDY, speculator=Speculator(fresh, k=1, adaptive=False))
        while dec.logits() is None:
            pass
        again = fresh.propose(history, 1, params, torch.Generator().manual_seed(0))
        torch.testing.assert_close(again.q[0], q, rtol=1e-4, atol=1e-5)


def test_a_service_with_spec_mtp_answers_as_without(models):
    """`--spec mtp` in the service (the worker's batched step): a greedy completion equals the one without,
    a request may turn it off, and one that asks for it where the server did not load it is refused."""
    from localmoe.errors import LocalMoEError
    from localmoe.runtime.service import ServerConfig, Service

    loaded = models[0]
    prompt = prompt_for(loaded.model)
    results = {}
    for mode in ("off", "mtp"):
        service = Service(loaded, ServerConfig(prefix_cache_entries=0, batching="on", spec=mode))
        prep = service.prepare_completion(prompt, 24, GREEDY, [])
        results[mode] = list(service.completion_here(prep))[-1][1]
        if mode == "off":
            with pytest.raises(LocalMoEError, match="not available"):
                service.prepare_completion(prompt, 24, GREEDY, [], spec="mtp")
        else:
            assert service.prepare_completion(prompt, 24, GREEDY, [], spec="off").speculator is None
    assert results["mtp"].content == results["off"].content
    assert results["mtp"].spec.drafted > 0 and results["off"].spec is None
    assert results["mtp"].completion_tokens == 24


def test_spec_mtp_loads_the_layer_only_when_asked(checkpoint):
    from localmoe.runtime.speculation import Speculation

    loaded = load_model(checkpoint, CONFIG, progress=False)
    said = []
    spec = Speculation(loaded, "mtp", warn=said.append)
    assert spec.mode == "mtp" and not said and spec.new().drafter.name == "mtp"
    assert Speculation(loaded, "prompt").head is None


def test_a_preempted_mtp_sequence_resumes_unchanged(models):
    """Preempted mid-decode (its cache freed), the sequence replays prompt and tokens, its MTP drafter keeps
    what it had (the replayed positions agree), and the greedy output is the plain one."""
    loaded = models[0]
    model = loaded.model
    prompt = prompt_for(model)
    want, _ = run(model, prompt)
    spec = Speculator(MTPDrafter(load_nextn(loaded)), k=3, adaptive=False)
    dec = Decoder(model, prompt, GREEDY, speculator=spec)
    out, preempted = [], 0
    while len(out) < len(want):
        if len(out) >= 10 and not preempted and dec.preemptible:
            dec.preempt()
            preempted = spec.stats.drafted
        logits = dec.logits()
        if logits is None:
            continue
        token = dec.sample(logits)
        out.append(token)
        dec.feed([token])
    assert out == want
    assert preempted and spec.stats.drafted > preempted  # drafted before, and again after the replay


@pytest.mark.parametrize("family", FAMILIES)
def test_the_mtp_layer_of_a_gguf_equals_the_checkpoints(tmp_path, family):
    """llama.cpp writes GLM-4.5's MTP layer as `blk.{L}.*` plus `blk.{L}.nextn.*` (models/base.py NEXTN_GGUF; the
    stacked experts split by the family's gguf_finish); DeepSeek's the same way (its converter drops the layer
    today; the layout is GLM's, with MLA's k_b / v_b joined by mla_finish over the extra layer): from an f32 GGUF
    of the checkpoint the layer gives the checkpoint's logits, and greedy decoding with it equals plain greedy
    decoding."""
    from localmoe.testing.moe_gguf import write_moe_gguf

    source = _checkpoint(family, tmp_path)
    gguf = load_model(write_moe_gguf(source, tmp_path / "glm.gguf", "f32"), CONFIG, progress=False)
    hf = load_model(source, CONFIG, progress=False)
    tokens, hidden = random_tokens(12, 4, hf.spec.vocab_size)[0], torch.randn(12, hf.spec.hidden_size)
    ours, theirs = load_nextn(gguf), load_nextn(hf)
    torch.testing.assert_close(ours.forward(tokens, hidden, ours.new_cache(16))[0],
                               theirs.forward(tokens, hidden, theirs.new_cache(16))[0], rtol=0, atol=0)
    prompt = prompt_for(gguf.model)
    want, _ = run(gguf.model, prompt)
    spec = Speculator(MTPDrafter(ours), k=3, adaptive=False)
    assert run(gguf.model, prompt, speculator=spec)[0] == want and spec.stats.drafted > 0


def test_plan_counts_the_mtp_layer_apart(models):
    """`localmoe plan` over a store whose MTP layer keeps its experts as extents counts the model's MoE layers
    (the tokens/s it predicts read those per token) and names the MTP layer apart: read only while `--spec mtp`
    drafts."""
    from click.testing import CliRunner

    from localmoe.cli import cli
    from localmoe.store.packed import PackedStore

    resident, stored = models
    with PackedStore(stored.source) as packed:
        moe = sum(1 for layer in packed.layers() if layer < resident.spec.num_layers)
        assert len(packed.layers()) == moe + 1
    out = CliRunner().invoke(cli, ["plan", str(stored.source), "--ram", "25%"])
    assert out.exit_code == 0, out.output
    assert f"; {moe} MoE layers (+ 1 MTP, read only with --spec mtp)," in out.output
