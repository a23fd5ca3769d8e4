"""Continuous batching in the engine worker: a request's greedy output does not depend on who else is
in the batch (2, 8, 16 sequences); sequences join and leave between steps; a cancelled sequence's
cache is released at once; the KV budget holds admissions and preempts a sequence, which resumes with
the output it has alone; a thinking budget and a forced tool call work inside a batch.

The worker is stepped by the test (`EngineWorker.step`, no thread), so joins and leaves happen at
known steps. The reference for a request is its output alone in a worker (`alone`).
"""

from __future__ import annotations

import pytest
import torch

from localmoe.chat import ChatMessage
from localmoe.engine.sampler import SamplingParams
from localmoe.runtime.service import ChatRequest, ServerConfig, Service
from localmoe.runtime.turn import Prepared, run_chat, run_completion
from localmoe.runtime.worker import EngineWorker, Job

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
           "The best way to learn", "Water boils at", "In 1969, the first", "A haiku about rain:"]


@pytest.fixture(scope="module")
def embedded():
    from localmoe.config import EngineConfig
    from localmoe.load import load_model

    return load_model(None, EngineConfig(threads=1), progress=False)


def completion(loaded, text: str, max_tokens: int) -> Prepared:
    return Prepared(prompt=loaded.tokenizer.encode(text, add_special_tokens=True), max_tokens=max_tokens,
                    params=GREEDY)


def job_of(work, results: dict, key) -> Job:
    def on_event(kind, payload):
        if kind in ("done", "error"):
            results[key] = payload

    return Job(work, on_event)


def alone(loaded, prep: Prepared):
    """`prep` alone in a worker."""
    tok, model = loaded.tokenizer, loaded.model
    worker, results = EngineWorker(max_active=2, batching="on"), {}
    worker.submit(job_of(lambda job: run_completion(tok, model, prep, job.emit, lambda: job.cancelled), results, "it"))
    run_all(worker, results, 1)
    return results["it"]


def run_all(worker: EngineWorker, results: dict, expected: int, limit: int = 10_000) -> None:
    for _ in range(limit):
        if len(results) == expected and not worker.active:
            return
        worker.step()
    raise AssertionError(f"the worker did not finish {expected} jobs in {limit} steps")


@pytest.mark.parametrize("n", [2, 8, 16])
def test_batched_greedy_equals_alone(embedded, n):
    preps = [completion(embedded, PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), 12) for i in range(n)]
    worker, results = EngineWorker(max_active=n, batching="on"), {}
    tok, model = embedded.tokenizer, embedded.model
    for i, prep in enumerate(preps):
        worker.submit(job_of(lambda job, p=prep: run_completion(tok, model, p, job.emit, lambda: job.cancelled),
                             results, i))
    run_all(worker, results, n)
    assert worker.batched_tokens >= n * 8  # the decode steps ran batched, not one sequence at a time
    assert worker.prompt_rows >= n  # the prompts ran as rows of the batched steps, in chunks sized by the load
    for i, prep in enumerate(preps):
        single = alone(embedded, prep)
        assert results[i].content == single.content, i
        assert results[i].completion_tokens == single.completion_tokens


def _auto_outputs(loaded, preps) -> tuple[list[str], bool, int]:
    """The first request's output with all of `preps` running in an "auto" worker, then alone; whether
    the worker ran fused steps, and the tokens it batched."""
    tok, model = loaded.tokenizer, loaded.model
    outputs, fused, batched = [], None, 0
    for group in (preps, preps[:1]):
        worker, results = EngineWorker(max_active=4), {}
        for i, prep in enumerate(group):
            worker.submit(job_of(lambda job, p=prep: run_completion(tok, model, p, job.emit, lambda: job.cancelled),
                                 results, i))
        run_all(worker, results, len(group))
        fused, batched = worker.fused, batched + worker.batched_tokens
        outputs.append(results[0].content)
    return outputs, fused, batched


def test_auto_batches_where_every_matrix_runs_a_multi_row_kernel(embedded):
    """The embedded model's matrices are GGUF blocks (ggml_gemv decodes a block once for all rows of a
    batch): "auto" batches it, and a request's output is the same with others running as alone."""
    outputs, fused, batched = _auto_outputs(embedded, [completion(embedded, text, 8) for text in PROMPTS[:4]])
    assert not fused and batched > 0
    assert outputs[0] == outputs[1]


def test_auto_batches_a_dense_model_through_its_plan():
    """The same model with fp32 weights: its dense plan runs the batched rows in one kernel call (engine/batch.py
    `rows_plan`), each row with the fused single-sequence step's bits, so "auto" batches it, and a request's
    output with others running equals its output alone and its output in an "off" worker (the fused step)."""
    from localmoe.config import EngineConfig
    from localmoe.engine.batch import rows_plan
    from localmoe.load import load_model

    loaded = load_model(None, EngineConfig(threads=1, dtype="float32"), progress=False)
    assert rows_plan(loaded.model) is not None
    preps = [completion(loaded, text, 8) for text in PROMPTS[:2]]
    outputs, fused, batched = _auto_outputs(loaded, preps)
    assert not fused and batched > 0
    assert outputs[0] == outputs[1]
    tok, model = loaded.tokenizer, loaded.model
    worker, results = EngineWorker(max_active=2, batching="off"), {}
    worker.submit(job_of(lambda job: run_completion(tok, model, preps[0], job.emit, lambda: job.cancelled),
                         results, 0))
    run_all(worker, results, 1)
    assert worker.fused and results[0].content == outputs[0]


def test_auto_batches_where_the_fused_plan_runs_the_rows(tmp_path, monkeypatch):
    """Kimi-Linear (KDA mixers) has a fused single-sequence step whose hybrid plan also runs a batched step's rows
    (engine/batch.py `rows_plan`: a step of one sequence costs the fused step, each row has its bits): "auto" batches.
    Without that plan the batched op-by-op step does not beat the fused step: "auto" keeps the fused step."""
    from localmoe.config import EngineConfig
    from localmoe.engine import batch
    from localmoe.load import load_model
    from localmoe.testing import write_checkpoint

    path = write_checkpoint("kimi_linear", tmp_path, "tiny", seed=0)
    model = load_model(path, EngineConfig(threads=1), progress=False).model
    assert batch.has_fused_step(model) and batch.rows_plan(model) is not None and batch.batching_pays(model)
    assert not EngineWorker().fused_for(model)
    monkeypatch.setattr(batch, "rows_plan", lambda model: None)
    assert not batch.batching_pays(model)
    assert EngineWorker().fused_for(model)


def test_sequences_join_and_leave_between_steps(embedded):
    """Three requests of different lengths arrive at different steps; each equals its output alone."""
    tok, model = embedded.tokenizer, embedded.model
    preps = {"a": completion(embedded, PROMPTS[0], 20), "b": completion(embedded, PROMPTS[1], 4),
             "c": completion(embedded, PROMPTS[2], 10)}
    worker, results = EngineWorker(max_active=8, batching="on"), {}

    def submit(key):
        worker.submit(job_of(lambda job, p=preps[key]: run_completion(tok, model, p, job.emit, lambda: job.cancelled),
                             results, key))

    submit("a")
    for _ in range(5):
        worker.step()
    submit("b")  # joins while a decodes
    worker.step()
    assert worker.active == 2
    for _ in range(3):
        worker.step()
    submit("c")
    for _ in range(8):
        worker.step()
    assert "b" in results and worker.active == 2  # b left; a and c go on
    run_all(worker, results, 3)
    for key, prep in preps.items():
        assert results[key].content == alone(embedded, prep).content, key


def test_cancellation_frees_the_sequence_cache_at_once(embedded):
    tok, model = embedded.tokenizer, embedded.model
    worker, results = EngineWorker(max_active=4, batching="on"), {}
    jobs = {}
    for key, text in (("keep", PROMPTS[0]), ("drop", PROMPTS[3] * 40)):
        prep = completion(embedded, text, 64)
        jobs[key] = job_of(lambda job, p=prep: run_completion(tok, model, p, job.emit, lambda: job.cancelled),
                           results, key)
        worker.submit(jobs[key])
    for _ in range(6):
        worker.step()
    both = worker.kv_bytes
    keep = next(r for r in worker._active if r.job is jobs["keep"]).wants.cache.nbytes()
    assert both > keep > 0
    jobs["drop"].cancel()
    worker.step()
    assert worker.active == 1
    assert worker.kv_bytes == keep  # the cancelled sequence's blocks are gone; the other's did not grow
    assert type(results["drop"]).__name__ == "CancelledError"
    run_all(worker, results, 2)
    assert worker.kv_bytes == 0


def test_kv_budget_holds_a_request_until_a_sequence_finishes(embedded):
    tok, model = embedded.tokenizer, embedded.model
    worker, results = EngineWorker(max_active=4, kv_budget=1, batching="on"), {}  # any running cache spends it
    for key in ("first", "second"):
        prep = completion(embedded, PROMPTS[0], 3)
        worker.submit(job_of(lambda job, p=prep: run_completion(tok, model, p, job.emit, lambda: job.cancelled),
                             results, key))
    worker.step()
    assert worker.active == 1 and worker.waiting == 1
    run_all(worker, results, 2)
    assert results["first"].content == results["second"].content


@pytest.mark.parametrize("preemption", ["recompute", "swap", "swap into a file"])
def test_preempted_sequence_resumes_with_the_output_it_has_alone(embedded, monkeypatch, tmp_path, preemption):
    """Two sequences outgrow the KV budget: the later one is preempted (its cache's memory freed at once:
    recomputed, or swapped out to a file), resumes when the first finishes (recompute: its prompt and tokens
    run again; swap: its cache read back) and gives what it gives alone; /metrics counts it while it waits.
    A swap folder that cannot be written (a file's path) falls back to recompute."""
    from localmoe.engine import cache as cache_module
    from localmoe.runtime.metrics import Metrics

    monkeypatch.setattr(cache_module, "BLOCK_TOKENS", 8)  # caches grow every 8 tokens
    tok, model = embedded.tokenizer, embedded.model
    block = model.new_cache(1, 64).nbytes()  # one block of every layer
    preps = {"first": completion(embedded, PROMPTS[0], 24), "later": completion(embedded, PROMPTS[2], 24)}
    swap_dir = tmp_path / "swap"
    if preemption == "swap into a file":
        swap_dir.write_text("")
    swapping = preemption == "swap"

    def files():
        return list(swap_dir.iterdir()) if swap_dir.is_dir() else []

    worker, results = EngineWorker(max_active=4, kv_budget=5 * block, batching="on",
                                   preemption="recompute" if preemption == "recompute" else "swap",
                                   swap_dir=str(swap_dir)), {}
    for key, prep in preps.items():
        worker.submit(job_of(lambda job, p=prep: run_completion(tok, model, p, job.emit, lambda: job.cancelled),
                             results, key))
    seen = set()
    for _ in range(200):
        if len(results) == 2:
            break
        worker.step()
        assert worker.kv_bytes <= 5 * block + 2 * block  # over the budget by at most a step's growth
        if worker.preempted:
            seen.add("preempted")
            dec = worker._preempted[0].wants
            if dec._replay:
                seen.add("replays")  # tokens it had generated run again on resume
            if dec.swapped:
                seen.add("swapped")
                assert dec.cache is None and len(files()) == 1
            assert worker.active + len(results) == 1  # the first runs (or just finished); the later waits
            text = Metrics().render(worker.waiting, worker.active, worker=worker)
            assert 'localmoe_sequences{state="preempted"} 1' in text and "localmoe_preemptions_total 1" in text
            assert f"localmoe_swaps_total {int(dec.swapped)}" in text
    assert seen == {"preempted", "swapped" if swapping else "replays"}
    assert worker.preemptions >= 1 and worker.kv_bytes == 0 and not files()
    assert worker.swaps == (worker.preemptions if swapping else 0)
    for key, prep in preps.items():
        assert results[key].content == alone(embedded, prep).content, key
        assert results[key].completion_tokens == 24


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_cancelling_a_preempted_sequence_closes_it(embedded, monkeypatch, tmp_path, preemption):
    """A preempted sequence cancelled while it waits is closed at the next step (a swapped-out cache's file
    is removed)."""
    from localmoe.engine import cache as cache_module

    monkeypatch.setattr(cache_module, "BLOCK_TOKENS", 8)
    tok, model = embedded.tokenizer, embedded.model
    block = model.new_cache(1, 64).nbytes()
    worker, results, jobs = EngineWorker(max_active=4, kv_budget=3 * block, batching="on", preemption=preemption,
                                         swap_dir=str(tmp_path)), {}, {}
    for key in ("first", "later"):
        prep = completion(embedded, PROMPTS[1], 24)
        jobs[key] = job_of(lambda job, p=prep: run_completion(tok, model, p, job.emit, lambda: job.cancelled),
                           results, key)
        worker.submit(jobs[key])
    for _ in range(100):
        worker.step()
        if worker.preempted:
            break
    assert worker.preempted == 1
    assert len(list(tmp_path.iterdir())) == (preemption == "swap")
    jobs["later"].cancel()
    worker.step()
    assert worker.preempted == 0 and type(results["later"]).__name__ == "CancelledError"
    assert not list(tmp_path.iterdir())
    run_all(worker, results, 2)
    assert results["first"].completion_tokens == 24


def test_stopping_removes_swapped_caches_and_the_private_folder(embedded, monkeypatch):
    """A worker stopped while a sequence is swapped out removes the cache's file and its private swap folder."""
    from pathlib import Path

    from localmoe.engine import cache as cache_module

    monkeypatch.setattr(cache_module, "BLOCK_TOKENS", 8)
    tok, model = embedded.tokenizer, embedded.model
    block = model.new_cache(1, 64).nbytes()
    worker, results = EngineWorker(max_active=4, kv_budget=3 * block, batching="on"), {}  # swap, private folder
    for key in ("first", "later"):
        prep = completion(embedded, PROMPTS[1], 24)
        worker.submit(job_of(lambda job, p=prep: run_completion(tok, model, p, job.emit, lambda: job.cancelled),
                             results, key))
    for _ in range(100):
        worker.step()
        if worker.preempted:
            break
    folder = Path(worker.swap_dir)
    assert worker.swaps == 1 and len(list(folder.iterdir())) == 1
    worker.stop()
    assert not folder.exists()
@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    from localmoe.testing import write_checkpoint

    path = write_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"), "tiny", seed=0)
    return load_model(path, EngineConfig(), progress=False)


def test_thinking_budget_and_forced_tool_call_inside_a_batch(gpt_oss):
    """gpt-oss (harmony; sliding windows, sinks, MoE): a reasoning budget of 3 tokens and a forced call
    batched with plain requests give what each gives alone."""
    service = Service(gpt_oss, ServerConfig())
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
    requests = {
        "budget": ChatRequest([ChatMessage("user", "Think, then answer.")], 24, GREEDY, reasoning_tokens=3),
        "tool": ChatRequest([ChatMessage("user", "Weather in Paris?")], 32, GREEDY, tools=[weather],
                            tool_mode="required"),
        "plain1": ChatRequest([ChatMessage("user", "Hello")], 16, GREEDY),
        "plain2": ChatRequest([ChatMessage("user", "Count to three")], 16, GREEDY),
    }
    fmt, tok, model = service.format, service.tokenizer, service.model

    def work(key):
        return lambda job: run_chat(fmt, tok, model, service.prepare_chat(requests[key])[0], job.emit,
                                    lambda: job.cancelled)

    worker, results = EngineWorker(max_active=8, batching="on"), {}
    for key in requests:
        worker.submit(job_of(work(key), results, key))
    run_all(worker, results, len(requests))
    assert worker.batched_tokens > 0
    assert results["budget"].reasoning_closed_by == "reasoning_tokens"
    assert results["budget"].reasoning_tokens == 3
    assert results["tool"].finish_reason == "tool_calls"
    assert [c.name for c in results["tool"].tool_calls] == ["get_weather"]
    for key in requests:
        single_worker, out = EngineWorker(max_active=1, batching="on"), {}
        single_worker.submit(job_of(work(key), out, "it"))
        run_all(single_worker, out, 1)
        single = out["it"]
        assert (results[key].content, results[key].reasoning) == (single.content, single.reasoning), key
        assert [(c.name, c.arguments) for c in results[key].tool_calls] == \
            [(c.name, c.arguments) for c in single.tool_calls], key


def test_run_command_honours_the_thinking_budget(tmp_path):
    """`localmoe run --thinking low` closes the reasoning at the low tier's limit (the runtime's turn)."""
    import json
    import subprocess
    import sys

    from localmoe.testing import write_checkpoint

    path = write_checkpoint("gpt_oss", tmp_path, "tiny", seed=0)
    done = subprocess.run([sys.executable, "-m", "localmoe", "run", "Think first.", "--model", str(path),
                           "--temperature", "0", "--max-tokens", "24", "--thinking", "low",
                           "--thinking-budgets", "low=3,high=4096,max=none", "--json"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["stats"]["reasoning_closed_by"] == "reasoning_tokens"
    assert answer["stats"]["reasoning_tokens"] == 3
    assert "thinking closed by the reasoning_tokens budget" in done.stderr


def test_prompt_rows_do_not_depend_on_the_chunking(embedded):
    """A prompt run as rows of batched steps (the worker's path for the embedded model) gives the same bits
    in chunks of 2, 3, 7 or all at once, beside another sequence's decode rows or prompt rows, or alone; against the prompt's
    own forward (fp32 GEMM on fp32 activations, `Decoder.logits`) only the int8 rounding of activations
    differs: the same greedy token, logits within 2% of their range (the decode rows' own rounding)."""
    from localmoe.engine.batch import rows_independent
    from localmoe.engine.generate import Decoder, decode_together

    tok, model = embedded.tokenizer, embedded.model
    assert rows_independent(model)
    prompt = tok.encode("Water boils at a lower temperature on a mountain because the air pressure", add_special_tokens=True)

    def rows(limit: int, beside: str | None = None):
        """The prompt's logits run in chunks of `limit` rows, beside another sequence that decodes
        ("decode") or whose prompt shares the steps (its chunk first, "prompt"), or alone."""
        dec = Decoder(model, prompt, GREEDY)
        other = Decoder(model, tok.encode("Once upon a time", add_special_tokens=True), GREEDY) if beside else None
        if beside == "decode":
            other.feed([other.sample(other.logits())])  # now decoding: its rows share the steps
        out = None
        while out is None:
            decoding = [other] if other is not None and other.decoding else []
            chunks = [(other, limit)] if other is not None and other.prefilling else []
            step = decode_together(decoding, False, chunks + [(dec, limit)])
            out = step[-1]
            if other is not None and step[0] is not None:
                other.feed([other.sample(step[0])])
        return out, dec.cache

    whole, cache = rows(512)
    for limit, beside in ((3, None), (7, "decode"), (7, "prompt"), (2, "prompt")):
        got, got_cache = rows(limit, beside)
        assert torch.equal(got, whole), (limit, beside)
        assert torch.equal(got_cache.layers[5].keys.read(len(prompt)), cache.layers[5].keys.read(len(prompt)))
    gemm = Decoder(model, prompt, GREEDY).logits()
    assert int(gemm.argmax()) == int(whole.argmax())
    assert (gemm - whole).abs().max() <= 0.02 * (gemm.max() - gemm.min())


def test_prompts_that_arrive_together_enter_together(embedded):
    """Short prompts submitted together share the first step's prompt budget (a whole chunk when nothing
    decodes): all of them run in it, as rows of one forward, and decode from the second step on; with
    sequences decoding, the budget (STEP_ROWS + PROMPT_ROWS less the decode rows, at least PROMPT_ROWS: 20 beside 4)
    goes to the prefilling sequences in arrival order."""
    from localmoe.runtime.worker import PROMPT_ROWS, STEP_ROWS

    tok, model = embedded.tokenizer, embedded.model
    worker, results = EngineWorker(max_active=16, batching="on"), {}
    first = PROMPTS[:4]
    for i, text in enumerate(first):
        prep = completion(embedded, text, 6)
        worker.submit(job_of(lambda job, p=prep: run_completion(tok, model, p, job.emit, lambda: job.cancelled),
                             results, i))
    worker.step()
    assert worker.prompt_rows == len(first) and all(r.wants.decoding for r in worker._active)
    later = [completion(embedded, text * 6, 6) for text in PROMPTS[:3]]
    for i, prep in enumerate(later):
        worker.submit(job_of(lambda job, p=prep: run_completion(tok, model, p, job.emit, lambda: job.cancelled),
                             results, f"later{i}"))
    worker.step()  # 4 decode rows: a budget of 16 + 8 - 4 prompt rows, the earliest of the later prompts first
    budget = max(PROMPT_ROWS, STEP_ROWS + PROMPT_ROWS - len(first))
    assert budget == 20 and sum(len(p.prompt) for p in later) > budget
    waiting = [r.wants for r in worker._active if r.wants.prefilling]
    taken = [len(d.in_cache) for d in waiting]
    assert sum(taken) == budget and taken[0] == min(budget, len(later[0].prompt))
    run_all(worker, results, len(first) + len(later))
    for i, text in enumerate(first):
        assert results[i].content == alone(embedded, completion(embedded, text, 6)).content, i


def test_a_burst_of_prompts_enters_in_one_step(embedded):
    """Where at least as many prompts wait as sequences decode, the step gives them a whole chunk of rows (not the
    STEP_ROWS + PROMPT_ROWS budget): all of them run in it beside the two decoding sequences, and every output
    equals its output alone."""
    from localmoe.runtime.worker import PROMPT_ROWS, STEP_ROWS

    tok, model = embedded.tokenizer, embedded.model
    worker, results = EngineWorker(max_active=16, batching="on"), {}
    first = PROMPTS[:2]
    for i, text in enumerate(first):
        prep = completion(embedded, text, 6)
        worker.submit(job_of(lambda job, p=prep: run_completion(tok, model, p, job.emit, lambda: job.cancelled),
                             results, i))
    worker.step()
    later = [completion(embedded, text * 6, 6) for text in PROMPTS[2:5]]
    assert sum(len(p.prompt) for p in later) > STEP_ROWS + PROMPT_ROWS
    for i, prep in enumerate(later):
        worker.submit(job_of(lambda job, p=prep: run_completion(tok, model, p, job.emit, lambda: job.cancelled),
                             results, f"later{i}"))
    worker.step()
    assert len(worker._active) == 5 and all(r.wants.decoding for r in worker._active)
    run_all(worker, results, len(first) + len(later))
    for i, text in enumerate(first):
        assert results[i].content == alone(embedded, completion(embedded, text, 6)).content, i
    for i, prep in enumerate(later):
        assert results[f"later{i}"].content == alone(embedded, prep).content, i


def test_auto_batches_a_moe_model_with_gqa_attention(gpt_oss):
    """gpt-oss (MoE, plain GQA) has a fused single-sequence step, but a batched step reads each routed
    expert once for all its tokens and runs every sequence's attention in one call: "auto" batches it."""
    from localmoe.engine.batch import batching_pays, has_fused_step

    assert has_fused_step(gpt_oss.model) and batching_pays(gpt_oss.model)
    assert not EngineWorker().fused_for(gpt_oss.model)
