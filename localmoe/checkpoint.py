"""`open_checkpoint(path)`: the one place a model path is recognised.

A GGUF file, an HF directory (config.json + safetensors, or config.json alone), a bare config
`.json` file or a localmoe packed store becomes a `Checkpoint`: its family, ModelSpec, tensor
names, the reader of its tensors and where its tokenizer comes from. `load`, `describe`, the
converter, `trace` and `calibrate` all start here; nothing is read beyond headers and metadata.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from localmoe.config import ModelSpec
from localmoe.errors import CheckpointError, LocalMoEError, UnsupportedModelError
from localmoe.models import family_for_gguf, family_for_model_type, runnable_model_types
from localmoe.models.base import ModelFamily, TensorMap

KINDS = ("gguf", "hf", "config", "store")  # "config": an HF config.json alone, no weights
_LAYER = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")  # a layer's index in an HF, store or GGUF tensor name


@dataclass
class Checkpoint:
    """A recognised checkpoint: what it is and how to read it (weights stay on disk)."""

    path: Path
    kind: str  # one of KINDS
    family: ModelFamily
    spec: ModelSpec
    reader: object = None  # GGUFFile / GGUFSplit, SafetensorsCheckpoint or PackedStore (None for a config alone)
    config: dict = field(default_factory=dict)  # the HF config.json ({} for a GGUF file)
    gguf_metadata: dict | None = None  # a GGUF file's, or a store converted from one

    def _stored_names(self) -> list[str]:
        if self.kind == "gguf":
            return self.reader.tensor_names()
        if self.kind == "hf":
            return list(self.reader.keys())
        return self.reader.dense_names() if self.kind == "store" else []

    def _nextn(self, name: str) -> int | None:
        """Which MTP / next-n layer (0 ..) a tensor belongs to; None: the model's own."""
        m = _LAYER.search(name)
        k = int(m.group(1)) - self.spec.num_layers if m else -1
        return k if 0 <= k < self.spec.nextn_layers else None

    @property
    def tensor_names(self) -> list[str]:
        """Names of the stored tensors (a store: its dense tensors; the routed experts are in its extents),
        without those of the MTP / next-n layers appended after the last layer (`ModelSpec.nextn_layers`):
        no part of the model, loaded only for `--spec mtp` (`nextn_tensor_names`)."""
        names = self._stored_names()
        return names if not self.spec.nextn_layers else [n for n in names if self._nextn(n) is None]

    def nextn_tensor_names(self, index: int | None = None) -> list[str]:
        """The stored tensors of MTP layer `index` (None: of every MTP layer); a store's dense ones (its routed
        experts are extents of layer num_layers + index, where `convert` wrote them so)."""
        if not self.spec.nextn_layers:
            return []
        return [n for n in self._stored_names() if (k := self._nextn(n)) is not None and index in (None, k)]

    @property
    def tensor_map(self) -> TensorMap:
        """Checkpoint tensor names -> canonical names: the family's GGUF map for GGUF tensors, else the HF one."""
        if self.gguf_metadata is not None:
            return self.family.gguf_tensors(self.gguf_metadata["general.architecture"])
        return self.family.hf_tensors

    def tokenizer(self):
        """The tokenizer: from the GGUF metadata, else the directory's tokenizer files."""
        from localmoe.tokenizer import tokenizer_from_gguf_metadata, tokenizer_from_hf_dir

        if self.gguf_metadata is not None:
            return tokenizer_from_gguf_metadata(self.gguf_metadata, str(self.path))
        return tokenizer_from_hf_dir(self.path)

    def require_runnable(self) -> None:
        """UnsupportedModelError unless this version's engine can run the family."""
        if not self.family.runnable:
            what = "stores" if self.kind == "store" else "checkpoints"
            raise UnsupportedModelError(f"{self.path}: {self.spec.model_type} {what} can be inspected and converted "
                                        f"(localmoe inspect / convert), but this version cannot run them yet; "
                                        f"runnable families: {', '.join(runnable_model_types())}")

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def read_config(config_path: Path) -> dict:
    """An HF config.json as a dict with a model_type (CheckpointError naming the file otherwise)."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{config_path}: cannot read the model config, not valid JSON ({e})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{config_path}: has no model_type field")
    return config


def open_checkpoint(path: str | Path | None) -> Checkpoint:
    """The checkpoint at `path`: a .gguf file, an HF directory, a config .json or a packed store
    (None: the embedded default model, fetched on first use)."""
    from localmoe.store.manifest import MANIFEST, PROGRESS

    if path is None:
        from localmoe.default_model import default_model_path

        path = default_model_path()
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory (expected a .gguf file, an HF model directory "
                              f"or a localmoe packed store)")
    if path.is_dir() and ((path / MANIFEST).exists() or (path / PROGRESS).exists()):
        return _open_store(path)
    if path.is_dir() or path.suffix == ".json":
        return _open_hf(path)
    return _open_gguf(path)


def _open_gguf(path: Path) -> Checkpoint:
    from localmoe.store.gguf_split import open_gguf

    gguf = open_gguf(path)
    family = family_for_gguf(gguf.architecture, str(path))
    if family.spec_from_gguf is None:
        raise UnsupportedModelError(f"{path}: the {family.name} family cannot read GGUF files")
    spec = family.spec_from_gguf(gguf.metadata, set(gguf.tensor_names()))
    return Checkpoint(path, "gguf", family, spec, gguf, gguf_metadata=gguf.metadata)


def _open_hf(path: Path) -> Checkpoint:
    config_path = path if path.is_file() else path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path}: a model directory needs config.json (HF layout) or manifest.json "
                              f"(a localmoe packed store)")
    config = read_config(config_path)
    family = family_for_model_type(config["model_type"], str(config_path))
    spec = family.spec_from_hf(config)
    if path.is_file() or not any(path.glob("*.safetensors")):
        return Checkpoint(path, "config", family, spec, config=config)
    from localmoe.store.safetensors import SafetensorsCheckpoint

    return Checkpoint(path, "hf", family, spec, SafetensorsCheckpoint(path), config=config)


def store_spec(store) -> ModelSpec:
    """The ModelSpec of a PackedStore's manifest (also one written before the spec held sub-configs)."""
    from localmoe.engine.specs import spec_from_dict

    try:
        return spec_from_dict(store.manifest.model_spec)
    except (KeyError, TypeError, ValueError, LocalMoEError) as e:
        raise CheckpointError(f"{store.path / 'manifest.json'} is corrupt: model_spec is not a valid ModelSpec "
                              f"({type(e).__name__}: {e}); convert the model again") from None


def _open_store(path: Path) -> Checkpoint:
    from localmoe.store.packed import PackedStore

    store = PackedStore(path)
    spec = store_spec(store)
    family = family_for_model_type(spec.model_type, str(path / "manifest.json"))
    config_file, meta_file = store.file("config"), store.file("gguf_metadata")
    config = json.loads(config_file.read_text()) if config_file is not None else {}
    metadata = json.loads(meta_file.read_text()) if config_file is None and meta_file is not None else None
    return Checkpoint(path, "store", family, spec, store, config=config, gguf_metadata=metadata)
