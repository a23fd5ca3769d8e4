"""Options shared by commands that load a model.

`model_options` adds --model, --dtype, --threads, --max-context, --expert-precision and the paging
flags (--ram, --gpu-mem, --policy, --io, --no-prefetch, --profile, --trace). --expert-precision and
the paging flags are not passed to the command function: they are kept on the click context and
`engine_config` picks them up,
so a command's signature and its `engine_config(dtype, threads, max_context)` call stay as they
were when it is given paging flags.
"""

from __future__ import annotations

import click

from localmoe.config import DTYPES, EXPERT_PRECISIONS, KV_CACHE_DTYPES, EngineConfig

kv_cache_dtype_option = click.option(
    "--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="float32", show_default=True,
    help="Storage of attention K/V and MLA latent rows; fp8 = e4m3 with one fp32 scale per token and head "
         "(about 1/4 of float32). Delta-rule state stays float32.")

_PAGING_META = "localmoe.paging"  # ctx.meta key: {EngineConfig field: raw option value}
POLICY_CHOICES = ("lru", "lfu", "lfru", "belady")
IO_CHOICES = ("odirect", "mmap")


def _keep(field: str):
    def callback(ctx: click.Context, _param, value):
        ctx.meta.setdefault(_PAGING_META, {})[field] = value
        return value

    return callback


def _paging_option(*decls, field: str, **kwargs):
    return click.option(*decls, expose_value=False, callback=_keep(field), **kwargs)


paging_option_list = [
    _paging_option("--ram", field="ram_budget", default="0", metavar="SIZE",
                   help="Host RAM for routed-expert slots of a packed store: bytes (8G, 512M) or % of the "
                        "store's expert bytes (25%); 0 = no pager, the OS page cache decides."),
    _paging_option("--gpu-mem", field="gpu_budget", default="0", metavar="SIZE",
                   help="Device memory per GPU for expert slots (needs CUDA); 0 = no GPU tier."),
    _paging_option("--policy", field="paging_policy", type=click.Choice(POLICY_CHOICES), default="lfru",
                   show_default=True, help="Which expert the RAM tier evicts (belady needs --trace)."),
    _paging_option("--io", field="paging_io", type=click.Choice(IO_CHOICES), default="odirect", show_default=True,
                   help="How extents are read: O_DIRECT preads (no page-cache copy) or mmap + madvise."),
    _paging_option("--no-prefetch", field="no_prefetch", is_flag=True,
                   help="No router lookahead and no parallel loads of a layer's chosen experts."),
    _paging_option("--profile", field="paging_profile", default="", metavar="PATH",
                   help="Calibration profile (localmoe calibrate): its hot experts are pinned in RAM."),
    _paging_option("--trace", field="paging_trace", default="", metavar="PATH",
                   help="Routing trace (localmoe trace) the belady oracle follows."),
]


def paging_options(function):
    """Only the paging flags (for commands that take the model another way)."""
    for option in reversed(paging_option_list):
        function = option(function)
    return function


def model_options(function):
    """--model, --dtype, --threads, --max-context and the paging flags (commands add
    `kv_cache_dtype_option` themselves)."""
    options = [
        click.option("--model", "-m", "model", default=None, metavar="PATH",
                     help="GGUF file, HF model directory or packed store (default: the embedded "
                          "SmolLM2-135M-Instruct)."),
        click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True,
                     help="Weight dtype for decode GEMVs; auto measures fp32 vs bf16 per matrix shape."),
        click.option("--threads", type=int, default=0, help="CPU threads (default: physical cores)."),
        click.option("--max-context", type=int, default=0,
                     help="Context length to allocate the cache for (default: min(model max, 8192))."),
        _paging_option("--expert-precision", field="expert_precision", type=click.Choice(EXPERT_PRECISIONS),
                       default="q8", show_default=True,
                       help="MXFP4 experts' activations: q8 rounds them to int8 per 32 values (as llama.cpp; "
                            "about 2x faster on AVX2), exact keeps float32."),
    ]
    for option in reversed(options):
        function = option(function)
    return paging_options(function)


def _expert_bytes_of(model: str | None) -> int | None:
    """Expert bytes of the packed store at `model` (for a --ram given in %), None if it is not one."""
    from pathlib import Path

    from localmoe.store.manifest import MANIFEST

    if model is None or not (Path(model).expanduser() / MANIFEST).exists():
        return None
    from localmoe.paging import expert_bytes
    from localmoe.store.packed import PackedStore

    return expert_bytes(PackedStore(Path(model).expanduser()))


def paging_fields(ctx: click.Context | None = None) -> dict:
    """EngineConfig's paging fields from the flags of the running command (empty outside one)."""
    from localmoe.commands.paged import parse_size
    from localmoe.errors import LocalMoEError

    ctx = ctx or click.get_current_context(silent=True)
    raw = dict(ctx.meta.get(_PAGING_META, {})) if ctx is not None else {}
    if not raw:
        return {}
    fields = {k: v for k, v in raw.items() if k not in ("ram_budget", "gpu_budget", "no_prefetch")}
    fields["prefetch"] = not raw.get("no_prefetch", False)
    model = ctx.params.get("model")
    for field, flag in (("ram_budget", "--ram"), ("gpu_budget", "--gpu-mem")):
        text = str(raw.get(field, "0"))
        total = _expert_bytes_of(model) if text.strip().endswith("%") else None
        if text.strip().endswith("%") and total is None:
            raise LocalMoEError(f"{flag} {text}: a percentage is of a packed store's expert bytes, and --model "
                                f"{model} is not a packed store; give bytes (8G, 512M)")
        fields[field] = parse_size(text, total)
    return fields


def engine_config(dtype: str, threads: int, max_context: int, kv_cache_dtype: str = "float32",
                  **paging) -> EngineConfig:
    """The EngineConfig of a command's flags; paging fields come from `paging` (EngineConfig names)
    or, when not given, from the running command's paging flags."""
    fields = paging_fields() | paging
    return EngineConfig(dtype=dtype, threads=threads, max_context=max_context, kv_cache_dtype=kv_cache_dtype,
                        **fields)
