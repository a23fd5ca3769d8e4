"""Batched greedy equals alone beyond the embedded model: 2, 8 and 16 sequences stepped together by the
engine worker (`batching="on"`: every decode step one batched forward, engine/batch.py) give each sequence
the tokens it gets alone, on the tiny gpt-oss (sliding windows, sinks, MXFP4 experts grouped by expert),
the tiny Kimi K3 (MLA + KDA + MoE, attention residuals) and the tiny gpt-oss served from a packed store
with its experts paged at a quarter of their bytes (tests/runtime/test_batching.py covers the embedded
model). Token ids are compared, not text: the tiny tokenizers' text is noise."""

from __future__ import annotations

import random

import pytest

from localmoe.config import EngineConfig
from localmoe.engine.generate import Decoder
from localmoe.engine.sampler import SamplingParams
from localmoe.load import load_model
from localmoe.runtime.worker import EngineWorker, Job
from localmoe.testing import write_checkpoint

GREEDY = SamplingParams(temperature=0.0)
STEPS = 10


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from localmoe.convert import convert
    from localmoe.paging import PagingConfig, expert_bytes
    from localmoe.store.packed import PackedStore

    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in ("gpt_oss", "kimi_k3", "qwen3_moe"):
        out[family] = load_model(write_checkpoint(family, root / family, "tiny", seed=0), EngineConfig(),
                                 progress=False).model
    store = root / "gpt_oss.lmoe"
    convert(root / "gpt_oss", store, experts="mxfp4")
    budget = expert_bytes(PackedStore(store)) // 4
    out["gpt_oss paged"] = load_model(store, EngineConfig(paging=PagingConfig(ram_budget=budget)), progress=False).model
    return out


def greedy_job(model, prompt: list[int], out: list[int], made: list | None = None, **decoder) -> Job:
    """A job that decodes STEPS greedy tokens of `prompt` into `out`, a step at a time through the worker
    (`decoder`: the Decoder's keyword arguments, such as `anchor` or `prefill_chunk`; `made`: a list that gets
    the job's Decoder once the worker starts it)."""
    def work(job):
        dec = Decoder(model, prompt, GREEDY, **decoder)
        if made is not None:
            made.append(dec)
        while len(out) < STEPS:
            logits = yield dec
            if logits is not None:
                out.append(dec.sample(logits))
                dec.feed(out[-1:])

    return Job(work, lambda kind, payload: None)


def run(model, prompts: list[list[int]]) -> tuple[list[list[int]], EngineWorker]:
    worker = EngineWorker(max_active=len(prompts), batching="on")
    outs: list[list[int]] = [[] for _ in prompts]
    for prompt, out in zip(prompts, outs):
        worker.submit(greedy_job(model, prompt, out))
    worker.step()  # the first step takes every job
    for _ in range(1000):
        if not worker.active:
            return outs, worker
        worker.step()
    raise AssertionError("the worker did not finish")


@pytest.mark.parametrize("n", [2, 8, 16])
@pytest.mark.parametrize("family", ["gpt_oss", "kimi_k3", "gpt_oss paged"])
def test_batched_greedy_equals_alone(models, family, n):
    model = models[family]
    rng = random.Random(n)
    prompts = [[rng.randrange(3, model.spec.vocab_size) for _ in range(rng.randrange(3, 12))] for _ in range(n)]
    batched, worker = run(model, prompts)
    assert worker.batched_tokens >= n * (STEPS - 2)  # the decode steps ran batched, not one sequence at a time
    for prompt, got in zip(prompts, batched):
        alone, _ = run(model, [prompt])
        assert got == alone[0]


def test_paged_step_reads_each_routed_expert_once(models):
    """The pager counts the (token, expert) pairs routed (`PagingStats.routed`, /metrics
    localmoe_expert_routes_total) beside its requests, one per distinct expert of a layer's step: with 16
    sequences batched the step reads fewer experts than were routed; one sequence's decode reads each."""
    from localmoe.runtime.metrics import Metrics, paging_stats

    model = models["gpt_oss paged"]
    stats = paging_stats(model)
    k, layers = model.spec.num_experts_per_tok, len(model.moe_blocks())
    rng = random.Random(3)
    prompts = [[rng.randrange(3, model.spec.vocab_size) for _ in range(6)] for _ in range(16)]
    for group in (prompts, prompts[:1]):
        stats.reset_counts()
        run(model, group)
        rows = sum(len(p) + STEPS - 1 for p in group)  # the last token drawn is not run
        assert stats.routed == rows * k * layers
        assert (stats.ram.requests < 0.8 * stats.routed) if len(group) == 16 else \
            (stats.ram.requests >= (STEPS - 1) * k * layers)
    text = Metrics().render(0, 0, dict(stats.tiers), routed=stats.routed)
    assert f"localmoe_expert_routes_total {stats.routed}" in text


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe", "gpt_oss paged"])
def test_moe_prompts_joining_mid_decode_run_as_rows(models, family):
    """A paged MoE model's prompts run as rows of the batched step (engine/batch.py `rows_independent`: MoE rows
    bit-independent), also those that arrive while others decode; a resident one's in forwards of their own: every
    sequence still gets its tokens alone (prompt chunks, decode rows and the step's union of experts do not change
    a sequence's bits), and the paged store's tokens (prompts as rows) are the resident model's (prompts in their
    own forwards: within ~1e-7, the same greedy tokens here)."""
    model = models[family]
    rng = random.Random(11)
    prompts = [[rng.randrange(3, model.spec.vocab_size) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    worker = EngineWorker(max_active=len(prompts), batching="on")
    outs: list[list[int]] = [[] for _ in prompts]
    for prompt, out in zip(prompts[:3], outs[:3]):
        worker.submit(greedy_job(model, prompt, out))
    while not all(outs[:3]):  # decoding when the others arrive
        worker.step()
    for prompt, out in zip(prompts[3:], outs[3:]):
        worker.submit(greedy_job(model, prompt, out))
    for _ in range(1000):
        if not worker.active:
            break
        worker.step()
    # a paged MoE model's prompts ran as rows of the batched steps; resident, each its own forward
    assert worker.prompt_rows >= len(prompts) if "paged" in family else worker.prompt_rows == 0
    resident = models[family.split()[0]]
    for prompt, got in zip(prompts, outs):
        alone, _ = run(model, [prompt])
        assert got == alone[0]
        if resident is not model:
            assert got == run(resident, [prompt])[0][0]


def test_moe_prompts_take_whole_chunks_beside_decode_rows(models):
    """A MoE model's step reads the routed experts once for all its rows: prompts waiting beside decode rows take a
    whole chunk each step (not the dense models' STEP_ROWS budget), so they enter together."""
    from localmoe.runtime.worker import STEP_ROWS

    model = models["gpt_oss paged"]
    rng = random.Random(5)
    worker = EngineWorker(max_active=8, batching="on")
    outs: list[list[int]] = [[] for _ in range(6)]
    for out in outs[:3]:
        worker.submit(greedy_job(model, [rng.randrange(3, model.spec.vocab_size) for _ in range(4)], out))
    while not all(outs[:3]):
        worker.step()
    later = [[rng.randrange(3, model.spec.vocab_size) for _ in range(12)] for _ in range(3)]
    assert sum(map(len, later)) > STEP_ROWS - 3
    for prompt, out in zip(later, outs[3:]):
        worker.submit(greedy_job(model, prompt, out))
    worker.step()
    assert all(r.wants.decoding for r in worker._active)  # every later prompt ran whole in that one step


def test_prompt_rows_cross_the_anchor_unless_the_cache_keeps_a_delta_state(models):
    """A prompt's rows in a batched step stop at its chunk boundaries (the anchor, `Decoder.chunk_size`) only where
    its cache snapshots a delta-rule state there for the prefix cache (Kimi K3's KDA layers); a K/V-only cache
    (gpt-oss) takes them across, so a short prompt enters in one step (the paged gpt-oss, whose prompts run as
    rows), and its tokens equal its tokens alone."""
    prompt = [3 + i for i in range(20)]
    assert Decoder(models["gpt_oss"], prompt, GREEDY, anchor=6).chunk_size(512) == 20
    assert Decoder(models["kimi_k3"], prompt, GREEDY, anchor=6).chunk_size(512) == 6
    assert Decoder(models["kimi_k3"], prompt, GREEDY).chunk_size(512) == 20
    for name, first in (("gpt_oss", 20), ("kimi_k3", 6)):  # the cache's layers are looked at once, not every call
        dec = Decoder(models[name], prompt, GREEDY, anchor=6)
        assert dec.chunk_size(512) == first
        layers, dec.cache.layers = dec.cache.layers, None
        assert dec.chunk_size(512) == first and dec.chunk_size(3) == 3
        dec.cache.layers = layers
    model = models["gpt_oss paged"]
    alone, _ = run(model, [prompt])
    worker = EngineWorker(max_active=2, batching="on")
    outs: list[list[int]] = [[], []]
    worker.submit(greedy_job(model, prompt[:5], outs[0]))
    worker.step()
    worker.submit(greedy_job(model, prompt, outs[1], anchor=6))
    worker.step()  # the anchored prompt runs whole as rows beside the first sequence's decode row
    assert all(r.wants.decoding for r in worker._active) and len(worker._active) == 2
    while worker.active:
        worker.step()
    assert outs[1] == alone[0]


def test_a_long_prompt_still_takes_one_chunk_a_step(models):
    """A step that takes every waiting prompt gives each at most its chunk (`Decoder.chunk`), so a long prompt
    delays the sequences decoding beside it by one chunk a step, as chunked prefill promises; its tokens equal alone."""
    model = models["gpt_oss paged"]
    rng = random.Random(7)
    prompt = [rng.randrange(3, model.spec.vocab_size) for _ in range(40)]
    alone, _ = run(model, [prompt])
    worker = EngineWorker(max_active=2, batching="on")
    outs: list[list[int]] = [[], []]
    worker.submit(greedy_job(model, prompt[:5], outs[0]))
    worker.step()
    worker.submit(greedy_job(model, prompt, outs[1], prefill_chunk=16))
    taken = []
    while not outs[1]:
        worker.step()
        second = next((r.wants for r in worker._active if r.wants.prompt == prompt), None)
        taken.append(len(second.in_cache) if second is not None else None)
    assert taken[:3] == [16, 32, 40], taken
    while worker.active:
        worker.step()
    assert outs[1] == alone[0]


@pytest.mark.parametrize("family", ["kimi_k3", "gpt_oss paged"])
def test_a_burst_with_one_header_starts_from_one_prefill_of_it(models, family):
    """Prompts with the same header (anchor) submitted together beside a prefix cache: the first prefills the header
    and leaves a copy (K3: its KDA states at the anchor, its MLA rows; the paged gpt-oss: K/V blocks, its prompts as
    rows of a step that takes them whole), the others wait for it and start from a copy each; every sequence's
    tokens equal its tokens alone (the same anchor, no prefix cache)."""
    from localmoe.engine.prefix_cache import PrefixCache

    model, cache = models[family], PrefixCache()
    rng = random.Random(5)
    header = [rng.randrange(3, model.spec.vocab_size) for _ in range(6)]
    prompts = [header + [rng.randrange(3, model.spec.vocab_size) for _ in range(5)] for _ in range(3)]
    worker, decoders = EngineWorker(max_active=3, batching="on"), []
    outs: list[list[int]] = [[] for _ in prompts]

    for prompt, out in zip(prompts, outs):
        worker.submit(greedy_job(model, prompt, out, decoders, anchor=6, prefix_cache=cache))
    while len(decoders) < 3 or worker.active:
        worker.step()
    assert [d.reused for d in decoders] == [0, 6, 6] and cache.hits == 2 and cache.misses == 1
    for prompt, got in zip(prompts, outs):
        alone: list[int] = []
        single = EngineWorker(max_active=1, batching="on")
        single.submit(greedy_job(model, prompt, alone, anchor=6))
        while len(alone) < STEPS or single.active:
            single.step()
        assert got == alone
