"""Speculative decoding, same run with and without: tokens/s, acceptance, tokens per step, expert bytes
read per generated token.

    python benchmarks/spec.py                          # (a) the embedded model, prompt lookup
    python benchmarks/spec.py --paged                  # + (b) a paged gpt-oss store, prompt lookup and a draft
    python benchmarks/spec.py --paged --work DIR --pairs 3
    python benchmarks/spec.py --paged-only --stores kimi_k3,deepseek_v32   # (c) and the MTP layer

(a) The embedded SmolLM2 (resident, its fused single-token step when off) on three prompts: a paragraph
    to repeat word for word (prompt lookup's best case), a question about a document asking for its
    sentences quoted (what the 135M model makes of it is its own), and a code edit that rewrites a file
    with one name changed; `--spec off` against `--spec prompt`.
(b) The generated gpt-oss `small` (8 layers x 16 MXFP4 experts, top-4) converted to a packed store and
    paged at 25% of its expert bytes (LFRU, O_DIRECT), greedy plain completions of the same two prompts:
    off, prompt lookup, and a draft model (the `tiny` gpt-oss: the same tokenizer, random weights of its
    own, so it shows what the scheduler does with a draft that is almost never right).
(c) The generated Kimi K3 `small` (MLA + KDA layers, latent MXFP4 MoE, attention residuals) converted and
    paged the same way: off, an oracle, prompt lookup, random drafts. `--stores deepseek_v32`: DeepSeek-V3.2
    `small` with an MTP layer appended (localmoe.testing.mtp), its store paged likewise, the MTP drafter
    (`--spec mtp`) beside the others. Random weights: the MTP layer was not trained to predict this model,
    so its acceptance shows the cost of drafting with it, not what a released checkpoint's head achieves.

(b') `--stores smollm_moe`: the embedded SmolLM2 upcycled to a MoE (upcycle.py: it answers as SmolLM2 does),
    paged at 25%; its draft model is the dense SmolLM2 it came from (the embedded GGUF, resident): `draft`
    drafts the next step in a thread while the target verifies and ends a draft before its first unsure token
    (as `--spec draft:` on a paged store), `draft-inline` drafts on the step's path up to the speculator's k
    (before session 16), `hybrid` takes prompt lookup's draft after a long match and the draft model's elsewhere
    (`--spec prompt+draft:`; `hybridN` with N the shortest match, asked for by --only); `draft-fp32` is `draft` with
    its catch-up through the fp32 GEMM on the dequantised copy (before session 17).

Each configuration runs in a process of its own, the order alternated every pair (alternate.py); the
ratios are per pair, the median printed, in wall-clock tokens/s from the first token and in process CPU
time (on a loaded machine the CPU ratio is the steadier one). `--batching off` (the default) compares with the
model's fused single-sequence step, as `run`, `chat`, `web` and the Python API take; `--batching auto` with the
step `serve` takes (for the embedded model, the batched 1-row step). The `chat` task has nothing to quote. `--also-k 7` adds prompt lookup at another
most drafts per step to (a), in the same run. Expert bytes are the pager's reads during decoding (from the
first generated token on) over the tokens generated.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from alternate import alternate, emit, median_ratio

from localmoe.config import SPEC_K

DOCUMENT = """The packed store keeps each routed expert in one page-aligned extent, so one read fetches the gate,
up and down matrices of an expert together with their scales. The pager keeps the hot experts in RAM
slots and reads the others from the drive on demand; its policy decides which slot an expert evicts.
Prefetch applies the next layer's router to the current hidden state and starts the reads of the experts
it predicts while the current layer computes. Every load, hit, miss, stall and byte is counted, and the
counts are shown by --stats, by the web app and on the server's /metrics endpoint."""
QUESTION = "Which sentences of the document are about the pager? Repeat them exactly as they are written."
CITE = "Quote the sentence that mentions --stats."

CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out


def normalise(values):
    """Scale values to the range 0..1."""
    low, high = min(values), max(values)
    span = high - low or 1.0
    return [(v - low) / span for v in values]
'''
EDIT = "Rename the function moving_average to rolling_mean and print the whole updated file, nothing else."

TASKS = {
    "quote": f"Repeat this paragraph exactly, word for word:\n\n{DOCUMENT}",
    "document": f"Document:\n{DOCUMENT}\n\n{CITE}",
    "paraphrase": f"Here is a document:\n\n{DOCUMENT}\n\n{QUESTION}",
    "code": f"Here is a Python file:\n\n```python\n{CODE}```\n\n{EDIT}",
    "chat": "Why is the sky blue? Explain it to a ten-year-old in a short paragraph.",  # nothing to quote
}


def worker(args) -> None:
    from localmoe.config import EngineConfig, PagingConfig
    from localmoe.engine.sampler import SamplingParams
    from localmoe.load import load_model
    from localmoe.paging.metrics import pager_of
    from localmoe.runtime.local import LocalModel
    from localmoe.runtime.service import ServerConfig

    paging = PagingConfig(ram_budget=args.ram) if args.ram else PagingConfig()
    loaded = load_model(args.model, EngineConfig(threads=args.threads, paging=paging), progress=False)
    local = LocalModel(loaded, ServerConfig(prefix_cache_entries=0, spec=args.spec, spec_k=args.k,
                                            batching=args.batching))
    pager = pager_of(loaded)

    def read() -> int:
        return 0 if pager is None else sum(t.bytes_read for t in pager.stats.tiers.values())

    params = SamplingParams(temperature=0.0)
    service = local.service
    if args.chat:
        events = local.events(TASKS[args.task], params, args.max_tokens)
    else:  # a plain completion: the random-weight store has no chat to speak of
        prep = service.prepare_completion(TASKS[args.task], args.max_tokens, params, [])
        events = service.completion_here(prep)
    started = time.perf_counter()
    first, bytes_first, text, result = None, 0, [], None
    for kind, payload in events:
        if kind == "done":
            result = payload
        else:
            if first is None:
                first, bytes_first, cpu_first = time.perf_counter(), read(), time.process_time()
            text.append(payload.text)
    end, cpu = time.perf_counter(), time.process_time() - cpu_first
    n = result.completion_tokens
    decode_s = result.seconds - result.time_to_first_token
    spec = result.spec
    emit({"tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0, "tokens": n,
          "cpu_tokens_per_s": (n - 1) / cpu if n > 1 and cpu > 0 else 0.0,
          "seconds": end - started, "acceptance": spec.acceptance if spec else None,
          "tokens_per_step": spec.tokens_per_step if spec else None,
          "bytes_per_token": (read() - bytes_first) / max(1, n - 1), "text": "".join(text)})


class Oracle:
    """Drafts the continuation a plain greedy run produced (every draft kept: the upper bound of a drafter)."""

    name = "oracle"

    def __init__(self, prompt_len: int, tokens: list[int]):
        self.prompt_len, self.tokens = prompt_len, tokens

    def propose(self, history, k, params, generator):
        from localmoe.engine.spec.drafters import Draft

        at = len(history) - self.prompt_len
        ok = list(history[self.prompt_len:]) == self.tokens[:at]
        return Draft(self.tokens[at:at + k] if ok else [])


class Noise:
    """Drafts random ids (almost never kept: what failing drafts cost, and what the scheduler does)."""

    name = "noise"

    def __init__(self, vocab: int):
        import random

        self.vocab, self.random = vocab, random.Random(0)

    def propose(self, history, k, params, generator):
        from localmoe.engine.spec.drafters import Draft

        return Draft([self.random.randrange(self.vocab) for _ in range(k)])


def step_worker(args) -> None:
    """(b): a greedy decode loop over the store's Decoder (plain: the fused step or the batched rows; oracle
    / noise / prompt drafters), timed from the first generated token; --record writes the plain tokens."""
    import json

    import torch

    from localmoe.config import EngineConfig, PagingConfig
    from localmoe.engine.generate import Decoder, decode_together
    from localmoe.engine.sampler import SamplingParams
    from localmoe.engine.spec.drafters import PromptLookup
    from localmoe.engine.spec.speculator import Speculator
    from localmoe.load import load_model
    from localmoe.paging.metrics import pager_of

    # fp32: dtype "auto" measures fp32 against bf16 per shape at load, so two processes may choose differently
    # and their greedy tokens part (the oracle drafts another process's tokens)
    loaded = load_model(args.model, EngineConfig(dtype="float32", threads=args.threads,
                                                 paging=PagingConfig(ram_budget=args.ram)), progress=False)
    torch.set_num_threads(args.threads)
    pager = pager_of(loaded)
    if args.chat:  # the chat template's prompt, as `run` / `chat` render it
        from localmoe.chat import ChatMessage, chat_format_for

        prompt = chat_format_for(loaded.spec, loaded.tokenizer).render([ChatMessage("user", TASKS[args.task])])
    else:
        prompt = loaded.tokenizer.encode(TASKS[args.task], add_special_tokens=True)
    kind = args.spec
    speculator = None
    if kind.startswith("oracle:"):
        speculator = Speculator(Oracle(len(prompt), json.loads(Path(kind[7:]).read_text())), args.k, adaptive=False)
    elif kind == "noise":
        speculator = Speculator(Noise(loaded.spec.vocab_size), args.k)
    elif kind == "mtp":
        from localmoe.engine.spec.mtp import MTPDrafter
        from localmoe.load import load_nextn

        speculator = Speculator(MTPDrafter(load_nextn(loaded)), args.k)
    elif kind in ("prompt", "prompt-blind", "prompt-nopf"):  # blind: without the residency cost model and its
        residency = None                                          # prefetch; nopf: the cost model, no prefetch
        if kind != "prompt-blind":
            from localmoe.engine.spec.residency import Residency, RouteBook
            from localmoe.paging import attach

            book = RouteBook()
            attach(loaded.model, pager, trace=book, lookahead=pager.prefetch_enabled)
            residency = Residency(pager, book, prefetch=kind == "prompt")
        speculator = Speculator(PromptLookup(tokenizer=loaded.tokenizer), args.k, residency=residency)
    elif kind.startswith(("draft:", "draft-inline:", "draft-fp32:", "hybrid")):  # inline: its drafts on the step's
        # path (before session 16); hybrid: prompt lookup where its match is long, else the draft model (`--spec
        # prompt+draft:`; hybridN: N the shortest match the lookup drafts after, else hybrid.py's LONG); fp32: the
        # catch-up through the fp32 GEMM (before session 17)
        from localmoe.engine.spec.draft_model import CONFIDENT, DraftModel

        name, _, path = kind.partition(":")
        if name == "draft-fp32":  # the catch-up through the fp32 GEMM on the dequantised copy (before session 17)
            import contextlib

            from localmoe.engine.spec import draft_model

            draft_model.block_rows = contextlib.nullcontext
        draft = load_model(path, EngineConfig(threads=args.threads), progress=False).model
        drafter = DraftModel(draft, loaded.spec.vocab_size, ahead=name != "draft-inline",
                             confident=CONFIDENT if name != "draft-inline" else 0.0)
        if name.startswith("hybrid"):
            from localmoe.engine.spec.hybrid import LONG, LookupThenModel

            drafter = LookupThenModel(PromptLookup(tokenizer=loaded.tokenizer), drafter, int(name[6:] or LONG))
        speculator = Speculator(drafter, args.k)
    started = time.perf_counter()  # the prompt's prefill (and a draft model's catch-up beside it) from here
    dec = Decoder(loaded.model, prompt, SamplingParams(temperature=0.0), speculator=speculator)
    out, first, read0 = [], None, 0
    while len(out) < args.paged_tokens:
        # the worker's step: fused where plain steps are (a speculating sequence's steps without a draft too)
        logits = decode_together([dec], kind != "rows")[0] if dec.decoding and not dec.ready else dec.logits()
        if logits is None:
            continue
        out.append(dec.sample(logits))
        if first is None:
            first, read0 = time.perf_counter(), sum(t.bytes_read for t in pager.stats.tiers.values())
            cpu_first = time.process_time()
            stall0 = pager.stats.ram.stall_seconds
        if out[-1] in loaded.tokenizer.stop_token_ids:
            break
        dec.feed([out[-1]])
    seconds, cpu = time.perf_counter() - first, time.process_time() - cpu_first
    read = sum(t.bytes_read for t in pager.stats.tiers.values()) - read0
    stall = pager.stats.ram.stall_seconds - stall0
    if args.record:
        Path(args.record).write_text(json.dumps(out))
    s = speculator.stats if speculator else None
    emit({"tokens_per_s": (len(out) - 1) / seconds, "cpu_tokens_per_s": (len(out) - 1) / cpu, "tokens": len(out),
          "first_token_s": first - started,
          "lookups": getattr(speculator.drafter, "lookups", None) if speculator else None,
          "drafted_steps": s.drafted_steps if s else None,
          "text": json.dumps(out),
          "acceptance": s.acceptance if s else None, "tokens_per_step": s.tokens_per_step if s else None,
          "bytes_per_token": read / (len(out) - 1), "stall": stall / seconds,
          "step_costs": {"t1": speculator.costs.t1(), "ratios": [speculator.costs.ratio(r) for r in range(2, speculator.k_max + 2)]}
          if speculator else None})


def command(args, model, spec, task, ram: int = 0, chat: bool = True) -> list[str]:
    spec, _, k = spec.partition("@")  # "prompt@4": another most drafts per step than --k
    cmd = [__file__, "--worker", "--spec", spec, "--task", task, "--k", k or str(args.k), "--threads", str(args.threads),
           "--max-tokens", str(args.max_tokens if chat else args.paged_tokens), "--paged-tokens", str(args.paged_tokens),
           "--ram", str(ram), "--batching", args.batching]
    cmd += ["--model", model] if model else []
    return cmd + (["--chat"] if chat else [])


def compare(args, label: str, model, specs: list[str], ram: int = 0, chat: bool = True) -> None:
    for task in args.tasks.split(","):
        workers = {spec: command(args, model, spec, task, ram, chat) for spec in specs}
        results = alternate(workers, args.pairs)
        base = results["off"]
        texts = {spec: {r["text"] for r in rs} for spec, rs in results.items()}
        print(f"\n{label}, {task}: {base[0]['tokens']} tokens, {args.pairs} pairs", flush=True)
        for spec in specs:
            rs = results[spec]
            rate = statistics.median(r["tokens_per_s"] for r in rs)
            line = f"  {spec:<24} {rate:7.2f} tokens/s"
            if spec != "off":
                line += (f"  {median_ratio([r['tokens_per_s'] for r in rs], [b['tokens_per_s'] for b in base]):.2f}x"
                         f" (CPU time {median_ratio([r['cpu_tokens_per_s'] for r in rs], [b['cpu_tokens_per_s'] for b in base]):.2f}x)"
                         f"  acceptance {statistics.median(r['acceptance'] for r in rs):.0%}"
                         f"  {statistics.median(r['tokens_per_step'] for r in rs):.2f} tokens/step")
                line += "" if texts[spec] == texts["off"] else "  (TEXT DIFFERS from off)"
            if ram:
                line += f"  {statistics.median(r['bytes_per_token'] for r in rs) / 1e6:.1f} MB experts/token"
            print(line, flush=True)
        if any(name.startswith("prompt") for name in results):
            print("  (prompt-blind: the default speculator, what `--spec prompt` runs; prompt: with the opt-in residency "
                  "cost model, `price_experts`, and its prefetch; prompt-nopf: the cost model without the prefetch)",
                  flush=True)


# (label, drafters beside fused / rows / oracle / noise, chat prompts) of each paged store
STORES = {
    "smollm_moe": (("(b') SmolLM2-135M upcycled to a MoE (30 layers x 8 experts = copies of its MLP, top-2; "
                    "real weights, so it quotes)"),
                   ("prompt", "prompt-nopf", "prompt-blind", "draft", "draft-inline", "draft-fp32", "hybrid"), True),
    "gpt_oss": ("(b) gpt-oss small", ("prompt", "draft"), False),
    "kimi_k3": ("(c) Kimi K3 small (K3-shaped: MLA + KDA, latent MXFP4 MoE, attention residuals)", ("prompt",), False),
    "deepseek_v32": ("DeepSeek-V3.2 small with an MTP layer (MLA + DSA, MoE)", ("prompt", "mtp"), False),
    "gpt_oss_large": ("(b) gpt-oss large (12 layers x 128 MXFP4 experts, top-4; random weights)",
                      ("prompt", "prompt-blind", "draft"), False),
}


def steps(args, family: str, store: str, draft: str, ram: int) -> None:
    """(b), (c), MTP: plain greedy (the fused step, and the batched rows a speculating sequence takes) against
    an oracle drafter (every draft kept), the family's drafters (prompt lookup, the tiny draft model, the MTP
    layer) and random drafts, on the paged store."""
    label, drafters, chat = STORES[family]
    for task in args.tasks.split(","):
        record = args.work / f"plain-{family}-{task}.json"
        base = command(args, store, "rows", task, ram, chat=chat) + ["--steps"]
        alternate({"rows": base + ["--record", str(record)]}, 1)
        names = ["fused", "rows", f"oracle:{record}",
                 *(f"{d}:{draft}" if d.startswith(("draft", "hybrid")) else d for d in drafters), "noise"]
        names += [f"{h}:{draft}" for h in (args.only or "").split(",") if h.startswith("hybrid") and h != "hybrid"
                  and "hybrid" in drafters]  # hybridN: another shortest lookup match, asked for by --only
        if args.only:
            names = [n for n in names if n.split(":")[0] in args.only.split(",")]
        workers = {name: command(args, store, name, task, ram, chat=chat) + ["--steps"] for name in names}
        results = alternate(workers, args.pairs)
        ref = results["fused"]
        plain_tokens = {r["text"] for r in results["rows"]} if "rows" in results else {record.read_text()}
        print(f"\n{label}, packed store at --ram 25%, {task}: {ref[0]['tokens']} tokens, "
              f"{args.pairs} pairs", flush=True)
        for name, rs in results.items():
            rate = statistics.median(r["tokens_per_s"] for r in rs)
            short = name.split(":")[0]
            line = (f"  {short:<12} {rate:7.2f} tokens/s  {median_ratio([r['tokens_per_s'] for r in rs], [b['tokens_per_s'] for b in ref]):.2f}x fused"
                    f" (CPU time {median_ratio([r['cpu_tokens_per_s'] for r in rs], [b['cpu_tokens_per_s'] for b in ref]):.2f}x)")
            if rs[0]["acceptance"] is not None:
                line += (f"  acceptance {statistics.median(r['acceptance'] for r in rs):.0%}"
                         f"  {statistics.median(r['tokens_per_step'] for r in rs):.2f} tokens/step")
            if name != "fused":
                line += "" if {r["text"] for r in rs} == plain_tokens else "  (TOKENS DIFFER from rows)"
            line += f"  {statistics.median(r['bytes_per_token'] for r in rs) / 1e6:.1f} MB experts/token"
            line += f"  first token {statistics.median(r['first_token_s'] for r in rs):.2f} s"
            if rs[0].get("lookups") is not None:  # the hybrid: verifies of the lookup's drafts / all verifies
                line += "  lookup " + " / ".join(f"{r['lookups']}/{r['drafted_steps']}" for r in rs)
            print(line, flush=True)


def paged_store(work: Path, family: str = "gpt_oss") -> tuple[str, str, int]:
    """The family's `small` store (written and converted once under `work`; DeepSeek-V3.2 with an MTP layer
    appended, localmoe.testing.mtp), 25% of its expert bytes, and the family's `tiny` checkpoint as a draft."""
    from localmoe.convert import convert
    from localmoe.paging import expert_bytes
    from localmoe.store.packed import PackedStore
    from localmoe.testing import write_checkpoint

    src, store, draft = work / f"{family}_small", work / f"{family}_small.lmoe", work / f"{family}_tiny"
    if family == "gpt_oss_large":  # 10.8 GB + its store: written by `python -m localmoe.testing gpt_oss DIR --size
        # large` and converted beforehand (work/gpt_oss-large{,.lmoe}); its draft model the `small` (same tokenizer)
        src, store, draft = work / "gpt_oss-large", work / "gpt_oss-large.lmoe", work / "gpt_oss_small"
        if not (store / "manifest.json").exists() or not (draft / "config.json").exists():
            raise SystemExit(f"gpt_oss_large needs {store} (converted) and {draft} (the `small`, any seed) under --work")
        return str(store), str(draft), expert_bytes(PackedStore(store)) // 4
    if family == "smollm_moe":
        src, store = work / family, work / f"{family}.lmoe"
    converted = (store / "manifest.json").exists()  # the source is needed only to convert (1.3 GB for smollm_moe)
    if not converted and family == "smollm_moe" and not (src / "config.json").exists():
        print("writing the upcycled SmolLM2 MoE checkpoint ...", flush=True)
        from upcycle import write_upcycled

        write_upcycled(src)
    elif not converted and not (src / "config.json").exists():
        print(f"writing the small {family} checkpoint ...", flush=True)
        write_checkpoint(family, src, size="small")
        if family == "deepseek_v32":
            from localmoe.testing.mtp import add_mtp_layer

            add_mtp_layer(src)
    if not converted:
        print("converting it to a packed store ...", flush=True)
        convert(src, store)
    if family == "smollm_moe":  # the dense model it was upcycled from, resident (its answers are the MoE's, nearly)
        from localmoe.default_model import default_model_path

        draft = default_model_path()
    elif not (draft / "config.json").exists():
        write_checkpoint(family, draft, size="tiny", seed=1)
    return str(store), str(draft), expert_bytes(PackedStore(store)) // 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None)
    ap.add_argument("--spec", default="off")
    ap.add_argument("--task", default="quote", choices=list(TASKS))
    ap.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ram", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--k", type=int, default=SPEC_K, help="most drafts per step (--spec-k)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batching", default="off", choices=("off", "auto", "on"),
                    help="the worker's step (off: the model's fused single-sequence step, as `run`, `chat` and the "
                         "Python API take; auto: as `serve` takes)")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens generated on the embedded model")
    ap.add_argument("--paged-tokens", type=int, default=48, help="tokens generated on the paged store")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--also-k", type=int, nargs="*", default=[], help="(a): prompt lookup at these --k as well")
    ap.add_argument("--paged", action="store_true", help="also (b), the paged gpt-oss store")
    ap.add_argument("--paged-only", action="store_true", help="(b) only")
    ap.add_argument("--stores", default="gpt_oss", help="the paged stores of --paged / --paged-only, comma-separated: "
                    "gpt_oss (b), kimi_k3 (c), deepseek_v32 (with an MTP layer: --spec mtp), smollm_moe (b'), "
                    "gpt_oss_large (b, generated beforehand)")
    ap.add_argument("--steps", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tasks", default=",".join(TASKS), help="the prompts, comma-separated")
    ap.add_argument("--record", default="", help=argparse.SUPPRESS)
    ap.add_argument("--only", default="", help="paged stores: only these configurations (fused,rows,oracle,prompt,...)")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("LOCALMOE_CACHE", Path.home() / ".cache" / "localmoe")) / "bench",
                    help="where the generated checkpoints and the store are kept (~1 GB)")
    args = ap.parse_args()
    if args.worker:
        step_worker(args) if args.steps else worker(args)
        return
    if not args.paged_only:
        compare(args, "(a) embedded SmolLM2, resident", None, ["off", "prompt"] + [f"prompt@{k}" for k in args.also_k])
    if args.paged or args.paged_only:
        args.work.mkdir(parents=True, exist_ok=True)
        for family in args.stores.split(","):
            store, draft, ram = paged_store(args.work, family)
            steps(args, family, store, draft, ram)


if __name__ == "__main__":
    main()
