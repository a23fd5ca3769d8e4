"""Write a planned test checkpoint to a directory: shards, index, config, tokenizer."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from tqdm import tqdm

from localmoe.errors import LocalMoEError
from localmoe.store.safetensors_writer import write_safetensors
from localmoe.testing.families import FAMILIES
from localmoe.testing.plan import Plan
from localmoe.testing.random_data import tensor_chunks
from localmoe.testing.tokenizer import generation_config, write_tokenizer

SIZES = ("tiny", "small", "large")
_OURS = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")


def plan_checkpoint(family: str, size: str = "tiny", *, shard_bytes: int | None | str = "default") -> Plan:
    """The checkpoint `write_checkpoint` would write, without writing it (sizes, shards)."""
    if family not in FAMILIES:
        raise LocalMoEError(f"unknown test family {family!r}; choose one of {', '.join(FAMILIES)}")
    return FAMILIES[family].plan(size, shard_bytes)


def write_checkpoint(family: str, path: str | os.PathLike, size: str = "tiny", seed: int = 0, *,
                     shard_bytes: int | None | str = "default", progress: bool = False, weights: bool = True) -> Path:
    """Write a random checkpoint of `family` in its real Hugging Face layout to `path`.

    Deterministic: the same (family, size, seed, shard_bytes) gives byte-identical files.
    Weights stream to disk (one chunk in memory at a time); config.json is written last,
    so a directory that has one is complete. Stale `model*.safetensors` files of an
    earlier write into the same directory are removed. Returns the directory. `weights=False` writes everything but
    the shards (config, tokenizer: for testing.planned.PlannedCheckpoint, which computes the tensors instead).
    """
    plan = plan_checkpoint(family, size, shard_bytes=shard_bytes)
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").unlink(missing_ok=True)
    keep = set(plan.shard_names) | ({"model.safetensors.index.json"} if len(plan.shards) > 1 else set()) if weights else set()
    for stale in directory.iterdir():
        if _OURS.match(stale.name) and stale.name not in keep:
            stale.unlink()

    specs = {t.name: t for t in plan.tensors}
    with tqdm(total=plan.total_bytes, unit="B", unit_scale=True, disable=not progress,
              desc=f"{family} {size}") as bar:
        for name, shard in zip(plan.shard_names, plan.shards) if weights else ():
            write_safetensors(directory / name, [t.entry for t in shard],
                              lambda e: tensor_chunks(seed, e.name, e.dtype, e.shape, specs[e.name].init),
                              metadata={"format": "pt"}, on_bytes=bar.update)
    if len(plan.shards) > 1 and weights:
        index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": dict(sorted(plan.weight_map().items()))}
        _write_json(directory / "model.safetensors.index.json", index)

    layout = FAMILIES[family].tokenizer
    files = FAMILIES[family].files
    for name, content in (files(FAMILIES[family].sizes[size]) if files is not None else {}).items():
        _write_json(directory / name, content)
    max_len = _max_positions(plan.config)
    write_tokenizer(directory, layout, max_len)
    _write_json(directory / "generation_config.json", generation_config(layout))
    _write_json(directory / "config.json", plan.config)
    return directory


def _max_positions(config: dict[str, Any]) -> int:
    text = config.get("text_config", config)
    return int(text.get("max_position_embeddings") or text.get("model_max_length") or 131072)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
