"""Speculative decoding in the runtime: inside the batched scheduler (speculating and plain sequences in
one step) a greedy request yields what it yields alone without speculation; `--spec` choices (prompt,
draft:PATH with its tokenizer check, mtp's message, bad values); statistics in the turn result and
/metrics."""

from __future__ import annotations

import pytest

from localmoe.chat import ChatMessage
from localmoe.config import EngineConfig
from localmoe.engine.spec.drafters import PromptLookup
from localmoe.engine.spec.speculator import SpecStats, Speculator
from localmoe.errors import LocalMoEError
from localmoe.load import load_model
from localmoe.runtime.metrics import Metrics
from localmoe.runtime.service import ChatRequest, ServerConfig, Service
from localmoe.runtime.speculation import Speculation
from localmoe.runtime.turn import run_completion
from localmoe.runtime.worker import EngineWorker
from localmoe.testing import write_checkpoint

from .test_batching import GREEDY, alone, completion, embedded, job_of, run_all  # noqa: F401 - fixture

QUOTE = ("Copy this sentence: the pager keeps the hot experts in RAM slots and reads the others from the "
         "drive on demand. Copy: the pager keeps the hot")
PROMPTS = [QUOTE, "The capital of France is", QUOTE + " experts in RAM", "def fibonacci(n):"]


def test_speculating_and_plain_sequences_in_one_batch(embedded):  # noqa: F811
    preps = [completion(embedded, text, 24) for text in PROMPTS]
    for i, prep in enumerate(preps):
        prep.speculator = Speculator(PromptLookup(), k=4, adaptive=False) if i % 2 == 0 else None
    worker, results = EngineWorker(max_active=4, batching="on"), {}
    tok, model = embedded.tokenizer, embedded.model
    for i, prep in enumerate(preps):
        worker.submit(job_of(lambda job, p=prep: run_completion(tok, model, p, job.emit, lambda: job.cancelled),
                             results, i))
    run_all(worker, results, len(preps))
    for i, prep in enumerate(preps):
        single = alone(embedded, completion(embedded, PROMPTS[i], 24))
        assert results[i].content == single.content, i
        assert results[i].completion_tokens == single.completion_tokens
    spec = results[0].spec
    assert spec.drafted > 0 and spec.accepted > 0 and spec.tokens_per_step > 1.0
    assert results[1].spec is None


def test_a_prompt_arriving_beside_a_speculating_sequence_runs_as_rows(embedded):  # noqa: F811
    """A request that arrives while another speculates prefills as rows of the verify's forward (as it would
    beside a plain sequence; before, it took its own prefill, which rounds differently), and both answers are
    what each gives alone."""
    first, second = completion(embedded, QUOTE, 24), completion(embedded, "The capital of France is", 12)
    first.speculator = Speculator(PromptLookup(), k=4, adaptive=False)
    worker, results = EngineWorker(max_active=4, batching="on"), {}
    tok, model = embedded.tokenizer, embedded.model
    worker.submit(job_of(lambda job: run_completion(tok, model, first, job.emit, lambda: job.cancelled), results, 0))
    for _ in range(200):  # until the first sequence decodes and has drafted
        worker.step()
        if first.speculator.stats.drafted:
            break
    assert first.speculator.stats.drafted and not results
    rows_before = worker.prompt_rows
    worker.submit(job_of(lambda job: run_completion(tok, model, second, job.emit, lambda: job.cancelled), results, 1))
    run_all(worker, results, 2)
    assert worker.prompt_rows > rows_before  # the second prompt's chunks ran as rows beside the verify
    for i, text, n in ((0, QUOTE, 24), (1, "The capital of France is", 12)):
        single = alone(embedded, completion(embedded, text, n))
        assert results[i].content == single.content, i
    assert results[0].spec.accepted > 0


def test_run_with_prompt_lookup_equals_off(embedded):  # noqa: F811
    outputs = {}
    for mode in ("off", "prompt"):
        service = Service(embedded, ServerConfig(prefix_cache_entries=0, batching="on", spec=mode))
        events = list(service.chat_here(ChatRequest([ChatMessage("user", QUOTE)], 32, GREEDY)))
        outputs[mode] = events[-1][1]
    assert outputs["prompt"].content == outputs["off"].content
    assert outputs["off"].spec is None
    assert outputs["prompt"].spec.steps > 0


@pytest.mark.parametrize("batching", ["on", "off"])
def test_prompt_lookup_and_a_draft_model_equal_off(embedded, smollm2_gguf, batching):  # noqa: F811
    """`--spec prompt+draft:PATH` (engine/spec/hybrid.py: the lookup after a long match, the draft model elsewhere;
    here the embedded model drafting for itself) gives off's answer token for token, and drafts."""
    outputs = {}
    for mode in ("off", f"prompt+draft:{smollm2_gguf}"):
        service = Service(embedded, ServerConfig(prefix_cache_entries=0, batching=batching, spec=mode))
        assert service.speculation.mode == mode.partition(":")[0]
        events = list(service.chat_here(ChatRequest([ChatMessage("user", QUOTE)], 32, GREEDY)))
        outputs[mode.partition(":")[0]] = events[-1][1]
    assert outputs["prompt+draft"].content == outputs["off"].content
    assert outputs["prompt+draft"].spec.accepted > 0


def test_a_speculating_turn_yields_max_tokens_when_drafts_are_kept_at_the_end(embedded):  # noqa: F811
    """Kept drafts fill the cache ahead of the tokens handed out: near max_tokens that must not end the turn
    early (the turns checked the cache's room, which those drafts took: a code edit stopped at 127 of 128)."""
    for n in range(10, 30, 3):
        want = alone(embedded, completion(embedded, QUOTE, n))
        prep = completion(embedded, QUOTE, n)
        prep.speculator = Speculator(PromptLookup(), k=7, adaptive=False)
        got = alone(embedded, prep)
        assert got.spec.accepted > 0
        assert (got.completion_tokens, got.content) == (want.completion_tokens, want.content), n
        service = Service(embedded, ServerConfig(prefix_cache_entries=0, batching="on", spec="prompt", spec_k=7))
        request = ChatRequest([ChatMessage("user", QUOTE)], n, GREEDY)
        plain = Service(embedded, ServerConfig(prefix_cache_entries=0, batching="on"))
        chat = {name: list(s.chat_here(request))[-1][1] for name, s in (("on", service), ("off", plain))}
        assert (chat["on"].completion_tokens, chat["on"].content) == (chat["off"].completion_tokens,
                                                                       chat["off"].content), n


DOCUMENT = """The packed store keeps each routed expert in one page-aligned extent, so one read fetches the gate,
up and down matrices of an expert together with their scales. The pager keeps the hot experts in RAM
slots and reads the others from the drive on demand; its policy decides which slot an expert evicts."""


def test_a_prompt_lookup_sequence_prefills_as_a_plain_one(embedded):  # noqa: F811
    """The worker runs a prompt-lookup sequence's prompt as rows of its batched step, as it does a plain one's
    (a prefill through `logits()` rounds differently, and this answer then parted from off at a near-tie)."""
    outputs, rows = {}, {}
    question = f"Here is a document:\n\n{DOCUMENT}\n\nWhich sentences of the document are about the pager?"
    for mode in ("off", "prompt"):
        service = Service(embedded, ServerConfig(prefix_cache_entries=0, spec=mode))
        events = list(service.chat_here(ChatRequest([ChatMessage("user", question)], 24, GREEDY)))
        outputs[mode], rows[mode] = events[-1][1].content, service.worker.prompt_rows
    assert outputs["prompt"] == outputs["off"]
    assert rows["prompt"] == rows["off"] > 0


def test_a_request_may_turn_speculation_off(embedded):  # noqa: F811
    service = Service(embedded, ServerConfig(prefix_cache_entries=0, spec="prompt"))
    prep, _ = service.prepare_chat(ChatRequest([ChatMessage("user", "hi")], 4, GREEDY, spec="off"))
    assert prep.speculator is None
    prep, _ = service.prepare_chat(ChatRequest([ChatMessage("user", "hi")], 4, GREEDY))
    assert prep.speculator is not None
    with pytest.raises(LocalMoEError, match="not available"):
        service.prepare_chat(ChatRequest([ChatMessage("user", "hi")], 4, GREEDY, spec="draft"))


def test_spec_choices(embedded, tmp_path):  # noqa: F811
    with pytest.raises(LocalMoEError, match="expected auto \| prompt"):
        Speculation(embedded, "lookahead")
    said = []
    assert Speculation(embedded, "mtp", warn=said.append).mode == "off"  # the embedded GGUF declares none
    assert "no multi-token-prediction heads" in said[0]
    config = EngineConfig(dtype="float32", threads=1)
    k3 = load_model(write_checkpoint("kimi_k3", tmp_path / "k3", "tiny", seed=0), config, progress=False)
    said.clear()
    assert Speculation(k3, "mtp", warn=said.append).mode == "off"
    assert "num_nextn_predict_layers = 0" in said[0]
    # a draft model must share the target's tokenizer
    other = write_checkpoint("qwen3_next", tmp_path / "qwen", "tiny", seed=1)
    with pytest.raises(LocalMoEError, match="tokenizer|vocabulary"):
        Speculation(k3, f"draft:{other}")
    with pytest.raises(LocalMoEError, match="tokenizer|vocabulary"):
        Speculation(k3, f"prompt+draft:{other}")
    same = write_checkpoint("kimi_k3", tmp_path / "k3-draft", "tiny", seed=1)
    spec = Speculation(k3, f"draft:{same}")
    assert spec.mode == "draft" and spec.new().drafter.name == "draft"
    spec = Speculation(k3, f"prompt+draft:{same}")
    assert spec.mode == "prompt+draft" and spec.new().drafter.name == "prompt+draft"
    assert spec.new("draft").drafter.name == "draft"  # a request may ask for the draft model alone
    with pytest.raises(LocalMoEError, match="expected auto"):
        Speculation(k3, "prompt+draft:")


def test_metrics_show_speculation():
    stats = SpecStats(steps=10, drafted_steps=8, drafted=32, accepted=24, emitted=34)
    text = Metrics().render(0, 0, spec=stats)
    assert "localmoe_spec_accepted_tokens_total 24" in text
    assert "localmoe_spec_acceptance_rate 0.75" in text
    assert "localmoe_spec_tokens_per_step 3.4" in text


BUDGET_BLOCKS = 14  # of 8 tokens: the later sequence is preempted after it kept drafts (measured: 8 of 8)


def test_a_speculating_sequence_is_preempted_and_resumes_unchanged(embedded, monkeypatch):  # noqa: F811
    """Two speculating sequences outgrow the KV budget: the later one is preempted mid-decode (its cache freed),
    resumes when the first finishes (prompt and tokens, kept drafts included, run again as rows, without
    drafts) and gives what it gives alone without speculation; it speculates again after the replay."""
    from localmoe.engine import cache as cache_module

    monkeypatch.setattr(cache_module, "BLOCK_TOKENS", 8)  # caches grow every 8 tokens
    tok, model = embedded.tokenizer, embedded.model
    block = model.new_cache(1, 64).nbytes()  # one block of every layer
    preps = {"first": completion(embedded, QUOTE, 24), "later": completion(embedded, PROMPTS[2], 24)}
    for prep in preps.values():
        prep.speculator = Speculator(PromptLookup(), k=4, adaptive=False)
    worker, results = EngineWorker(max_active=4, kv_budget=BUDGET_BLOCKS * block, batching="on"), {}
    for key, prep in preps.items():
        worker.submit(job_of(lambda job, p=prep: run_completion(tok, model, p, job.emit, lambda: job.cancelled),
                             results, key))
    later = preps["later"].speculator.stats
    at_preemption = None
    for _ in range(400):
        if len(results) == 2:
            break
        worker.step()
        if worker.preempted and worker._preempted[0].wants._replay and at_preemption is None:
            at_preemption = (later.accepted, later.drafted)  # tokens it had generated run again on resume
    assert at_preemption is not None and worker.preemptions >= 1 and worker.kv_bytes == 0
    assert at_preemption[0] > 0, "it had kept no draft before it was preempted: the replay of kept drafts is untested"
    assert later.drafted > at_preemption[1], "it did not speculate again after the replay"
    for key, prep in preps.items():
        plain = completion(embedded, QUOTE if key == "first" else PROMPTS[2], 24)
        assert results[key].content == alone(embedded, plain).content, key
        assert results[key].completion_tokens == 24
