"""The model-info panel: what `localmoe inspect` says about the served model, plus how this
process runs it (engine settings, chat format, paging)."""

from __future__ import annotations

from pathlib import Path


def model_markdown(service) -> str:
    """Markdown for the panel; a model the inspector cannot read still gets its settings shown."""
    from localmoe.describe import describe_model, format_description
    from localmoe.errors import LocalMoEError
    from localmoe.paging.metrics import stats_line

    loaded = service.loaded
    config = loaded.config
    fmt = service.format
    lines = [
        f"**{service.model_id}** — `{Path(str(loaded.source)).name}`",
        "",
        "| setting | value |",
        "| --- | --- |",
        f"| architecture | {loaded.spec.model_type} |",
        f"| context allocated | {service.context} tokens |",
        f"| chat format | {fmt.name}{' (reasons before answering)' if fmt.thinks else ''} |",
        (f"| engine | {config.device}, {config.resolved_threads()} threads, weights {config.dtype}, "
         f"KV cache {config.kv_cache_dtype} |"),
        f"| expert paging | {stats_line(loaded) or 'none (all weights resident)'} |",
        "",
    ]
    try:
        description = format_description(describe_model(loaded.source, config))
    except (LocalMoEError, OSError, ValueError) as e:
        description = f"(the inspector could not read {loaded.source}: {e})"
    lines += ["```text", description, "```"]
    return "\n".join(lines)
