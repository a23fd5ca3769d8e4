"""Options shared by commands that load a model."""

from __future__ import annotations

import click

from localmoe.config import DTYPES, KV_CACHE_DTYPES, EngineConfig

kv_cache_dtype_option = click.option(
    "--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="float32", show_default=True,
    help="Storage of attention K/V and MLA latent rows; fp8 = e4m3 with one fp32 scale per token and head "
         "(about 1/4 of float32). Delta-rule state stays float32.")


def model_options(function):
    """--model, --dtype, --threads, --max-context (commands add `kv_cache_dtype_option` themselves)."""
    options = [
        click.option("--model", "-m", "model", default=None, metavar="PATH",
                     help="GGUF file or HF model directory (default: the embedded SmolLM2-135M-Instruct)."),
        click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True,
                     help="Weight dtype for decode GEMVs; auto measures fp32 vs bf16 per matrix shape."),
        click.option("--threads", type=int, default=0, help="CPU threads (default: physical cores)."),
        click.option("--max-context", type=int, default=0,
                     help="Context length to allocate the cache for (default: min(model max, 8192))."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def engine_config(dtype: str, threads: int, max_context: int, kv_cache_dtype: str = "float32") -> EngineConfig:
    return EngineConfig(dtype=dtype, threads=threads, max_context=max_context, kv_cache_dtype=kv_cache_dtype)
