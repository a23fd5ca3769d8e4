"""Options shared by the commands, declared once.

`model_options` adds --model, --dtype, --threads, --max-context, --kv-cache-dtype,
--expert-precision and the paging flags, and hands the command two values: `model` (the path)
and `engine` (the `EngineConfig` they make, its paging flags one nested `PagingConfig`).
`paging_options(model_param)` adds only the paging flags and hands over `paging` (for commands
that take the store as an argument). The thinking-budget options build their values here too.
"""

from __future__ import annotations

import functools
from pathlib import Path

import click

from localmoe.config import (
    DTYPES,
    EXPERT_PRECISIONS,
    KV_CACHE_DTYPES,
    PAGING_IO,
    PAGING_POLICIES,
    SPEC_K,
    EngineConfig,
    PagingConfig,
)

kv_cache_dtype_option = click.option(
    "--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="float32", show_default=True,
    help="Storage of attention K/V and MLA latent rows; fp8 = e4m3 with one fp32 scale per token and head "
         "(about 1/4 of float32). Delta-rule state stays float32.")

_PAGING_FLAGS = [
    click.option("--ram", "ram", default="0", metavar="SIZE",
                 help="Host RAM for routed-expert slots of a packed store: bytes (8G, 512M) or % of the "
                      "store's expert bytes (25%); 0 = no pager, the OS page cache decides."),
    click.option("--gpu-mem", "gpu_mem", default="0", metavar="SIZE",
                 help="Device memory per GPU for expert slots (needs CUDA); 0 = no GPU tier."),
    click.option("--policy", "policy", type=click.Choice(PAGING_POLICIES), default="lfru", show_default=True,
                 help="Which expert the RAM tier evicts (belady needs --trace)."),
    click.option("--io", "io", type=click.Choice(PAGING_IO), default="odirect", show_default=True,
                 help="How extents are read: O_DIRECT preads (no page-cache copy) or mmap + madvise."),
    click.option("--no-prefetch", "no_prefetch", is_flag=True,
                 help="No router lookahead and no parallel loads of a layer's chosen experts."),
    click.option("--profile", "profile", default="", metavar="PATH",
                 help="Calibration profile (localmoe calibrate): its hot experts are pinned in RAM."),
    click.option("--trace", "paging_trace", default="", metavar="PATH",
                 help="Routing trace (localmoe trace) the belady oracle follows."),
]
_PAGING_PARAMS = ("ram", "gpu_mem", "policy", "io", "no_prefetch", "profile", "paging_trace")


def _expert_bytes_of(model: str | None) -> int | None:
    """Expert bytes of the packed store at `model` (for a --ram given in %), None if it is not one."""
    from localmoe.store.manifest import MANIFEST

    if model is None or not (Path(model).expanduser() / MANIFEST).exists():
        return None
    from localmoe.paging import expert_bytes
    from localmoe.store.packed import PackedStore

    with PackedStore(Path(model).expanduser()) as store:
        return expert_bytes(store)


def _paging_config(model: str | None, ram: str, gpu_mem: str, policy: str, io: str, no_prefetch: bool, profile: str,
                   paging_trace: str) -> PagingConfig:
    """The PagingConfig of the paging flags; a size in % is of the packed store `model`'s expert bytes."""
    from localmoe.commands.paged import parse_size
    from localmoe.errors import LocalMoEError

    budgets = {}
    for field, flag, text in (("ram_budget", "--ram", ram), ("gpu_budget", "--gpu-mem", gpu_mem)):
        total = _expert_bytes_of(model) if text.strip().endswith("%") else None
        if text.strip().endswith("%") and total is None:
            raise LocalMoEError(f"{flag} {text}: a percentage is of a packed store's expert bytes, and --model "
                                f"{model} is not a packed store; give bytes (8G, 512M)")
        budgets[field] = parse_size(text, total)
    return PagingConfig(**budgets, policy=policy, io=io, prefetch=not no_prefetch, profile=profile,
                        trace=paging_trace)


def _decorate(function, options: list):
    for option in reversed(options):
        function = option(function)
    return function


def paging_options(model_param: str):
    """The paging flags, handed to the command as `paging` (a PagingConfig); % sizes are of the
    packed store named by the command's `model_param` argument."""

    def decorator(function):
        @functools.wraps(function)
        def command(**kwargs):
            flags = {name: kwargs.pop(name) for name in _PAGING_PARAMS}
            return function(paging=_paging_config(kwargs.get(model_param), **flags), **kwargs)

        return _decorate(command, _PAGING_FLAGS)

    return decorator


def model_options(function):
    """--model and every engine flag; the command gets `model` and `engine` (an EngineConfig)."""

    @functools.wraps(function)
    def command(*, dtype, threads, max_context, kv_cache_dtype, expert_precision, paging, **kwargs):
        engine = EngineConfig(dtype=dtype, threads=threads, max_context=max_context, kv_cache_dtype=kv_cache_dtype,
                              expert_precision=expert_precision, paging=paging)
        return function(engine=engine, **kwargs)

    options = [
        click.option("--model", "-m", "model", default=None, metavar="PATH",
                     help="GGUF file, HF model directory or packed store (default: the embedded "
                          "SmolLM2-135M-Instruct)."),
        click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True,
                     help="Weight dtype for decode GEMVs; auto measures fp32 vs bf16 per matrix shape."),
        click.option("--threads", type=int, default=0, help="CPU threads (default: physical cores)."),
        click.option("--max-context", type=int, default=0,
                     help="Context length to allocate the cache for (default: min(model max, 8192))."),
        kv_cache_dtype_option,
        click.option("--expert-precision", type=click.Choice(EXPERT_PRECISIONS), default="q8", show_default=True,
                     help="Activations of routed experts (MXFP4 or GGUF blocks) and a MoE GGUF's block lm_head's: "
                          "q8 rounds them to int8 per 32 values, per 256 for K-quants (as llama.cpp; about 2x "
                          "faster on AVX2), and a dense GGUF's Q8_0 lm_head's to int16 per 32; q8-all rounds every "
                          "model's GGUF block lm_head to int8 (llama.cpp's numerics); exact keeps float32."),
    ]
    return _decorate(paging_options("model")(command), options)


def budget_option(help: str):
    """--budget: the thinking-budget tier (low / high / max) to start with."""
    from localmoe.chat.format import REASONING_EFFORTS

    return click.option("--budget", type=click.Choice(REASONING_EFFORTS), default="high", show_default=True,
                        help=help)


def thinking_budgets_option(function):
    """--thinking-budgets, handed over as `thinking_budgets` (a ThinkingBudgets)."""
    from localmoe.chat.budget import ThinkingBudgets

    @functools.wraps(function)
    def command(*, thinking_budgets: str, **kwargs):
        return function(thinking_budgets=ThinkingBudgets.parse(thinking_budgets), **kwargs)

    return click.option("--thinking-budgets", default=str(ThinkingBudgets()), show_default=True,
                        help="Reasoning-token limit of each thinking-budget tier (reasoning_effort over the API).")(
        command)


allowed_hosts_option = click.option(
    "--allowed-hosts", "allowed_hosts", multiple=True, metavar="NAME",
    callback=lambda ctx, param, value: tuple(n for v in value for n in v.split(",")),
    help="A Host header name the server answers besides the loopback names and the bound address "
         "(repeatable or comma-separated; '*': any). Others get 403 (DNS-rebinding defence).")


def batching_option(default: str):
    """--batching, handed over as `batching`: `serve` batches by default (agents send requests at once); the chat
    apps default to each conversation's own fused step (one user: batching's 1-row step is the slower one)."""
    return click.option(
        "--batching", type=click.Choice(["auto", "on", "off"]), default=default, show_default=True,
        help="Decode step of concurrent sequences: on = one batched forward over all of them; off = each "
             "sequence's own (fused) step in turn, the fastest for one user; auto = batched where it pays (models "
             "without a fused single-sequence step, GGUF-block models, MoE models with plain GQA attention).")


def spec_options(function=None, *, default: str = "auto"):
    """--spec and --spec-k (speculative decoding, runtime/speculation.py), handed over as `spec` and `spec_k`.
    The default, auto, is prompt lookup on a model resident in RAM on the CPU (measured faster on every
    resident task, never slower on free answers) and off on a paged store or the GPU; `serve` passes "off"
    (its requests choose their own: a batched step's verify rows compete with the other clients' rows, not
    measured to pay); `analyze` passes "prompt" (its answers quote the passages: docs/performance.md
    "Speculative decoding")."""
    if function is None:
        return lambda f: spec_options(f, default=default)
    options = [
        click.option("--spec", "spec", default=default, show_default=True, metavar="auto|prompt|draft:PATH|prompt+draft:PATH|mtp|off",
                     help="Speculative decoding: auto = prompt lookup where the model runs from RAM on the CPU, off on a "
                          "paged store or the GPU; prompt = draft from n-grams of the prompt and the answer so far "
                          "(pays on answers that quote the prompt: document Q&A, code edits); draft:PATH = a "
                          "smaller model with the same tokenizer; prompt+draft:PATH = prompt lookup where the answer "
                          "quotes (a long match), the draft model elsewhere; mtp = the checkpoint's MTP / next-n layer "
                          "(DeepSeek-V3/V3.2, GLM-4.5: HF checkpoints, their stores, GGUF files; loaded only then; a model "
                          "without one says so and runs off). Lossless: the output is what the model alone would give."),
        click.option("--spec-k", "spec_k", type=int, default=SPEC_K, show_default=True,
                     help="Most drafted tokens per step; fewer (or none) where measured acceptance and step "
                          "time say more do not pay."),
    ]
    return _decorate(function, options)
