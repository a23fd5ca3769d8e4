"""The packed store's index: `manifest.json` and the resume journal `.progress.json`.

Both are JSON, written atomically (`write_atomic`: temp file, fsync, rename, fsync of
the directory). `Manifest.parse` checks every field a reader relies on and raises a
CheckpointError naming manifest.json and the field. The journal is only an
optimisation: one that cannot be read is ignored and the conversion starts over.
The schema is documented in docs/store-format.md.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from localmoe.errors import CheckpointError
from localmoe.store.extents import ALIGN, CHECKSUM, ExpertLayout

FORMAT = "localmoe-packed-store"
VERSION = 1  # bumped only for changes an older reader would misread; additions keep it
MANIFEST = "manifest.json"
PROGRESS = ".progress.json"
PROGRESS_FORMAT = "localmoe-packed-progress"
PARTIAL = ".partial"  # suffix of every file still being written

_HEX64 = re.compile(r"[0-9a-f]{16}")


def layer_file_name(layer: int) -> str:
    return f"experts/layer-{layer:04d}.bin"


def dense_file_name(index: int) -> str:
    return f"dense-{index + 1:05d}.safetensors"


@dataclass(slots=True)
class FileRecord:
    """A file checksummed as a whole: a dense shard or an extra file (tokenizer, template, ...)."""

    file: str  # relative to the store
    nbytes: int
    xxh3_64: str
    role: str = ""  # extra files: "tokenizer", "tokenizer_config", "chat_template", "gguf_metadata", ...
    tensors: list[str] = field(default_factory=list)  # dense shards: tensor names, in file order

    def to_dict(self) -> dict:
        out: dict = {"file": self.file, "nbytes": self.nbytes, CHECKSUM: self.xxh3_64}
        if self.role:
            out["role"] = self.role
        return out


@dataclass(slots=True)
class LayerRecord:
    """One layer file: expert `experts[i]` is the extent at offset i * slot_bytes of its layout."""

    layer: int
    file: str
    layout: str
    experts: list[int]
    xxh3_64: list[str]

    def to_dict(self) -> dict:
        return {"layer": self.layer, "file": self.file, "layout": self.layout,
                "experts": self.experts, CHECKSUM: self.xxh3_64}


@dataclass(slots=True)
class Manifest:
    model_spec: dict
    files: list[FileRecord]
    dense_shards: list[FileRecord]
    layouts: dict[str, ExpertLayout]
    layers: list[LayerRecord]

    def to_json(self) -> str:
        """Indented JSON, one line per layer record (K3's 82k experts stay ~2 MB and diff-able)."""
        tensors = {name: shard.file for shard in self.dense_shards for name in shard.tensors}
        head = {"format": FORMAT, "version": VERSION, "alignment": ALIGN, "checksum": CHECKSUM,
                "model_spec": self.model_spec, "files": [f.to_dict() for f in self.files],
                "dense": {"shards": [s.to_dict() for s in self.dense_shards], "tensors": tensors},
                "expert_layouts": {name: layout.to_dict() for name, layout in self.layouts.items()}}
        layers = ",\n".join("    " + json.dumps(r.to_dict()) for r in self.layers)
        return _pretty(head)[:-2] + ',\n  "experts": [\n' + layers + "\n  ]\n}\n"

    @classmethod
    def parse(cls, text: str, path: Path) -> Manifest:
        """Parse and check manifest.json (`path` is only for messages)."""
        def bad(what: str) -> CheckpointError:
            return CheckpointError(f"{path} is corrupt: {what}; convert the model again")

        try:
            doc = json.loads(text)
        except ValueError as e:
            raise bad(f"not valid JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise bad(f"its format is {doc.get('format') if isinstance(doc, dict) else None!r}, not {FORMAT!r}")
        if type(doc.get("version")) is not int:
            raise bad("it has no integer version")
        if doc["version"] > VERSION:
            raise CheckpointError(f"{path} is packed store format version {doc['version']}, newer than this "
                                  f"localmoe reads ({VERSION}); upgrade localmoe")
        if doc["version"] < VERSION:
            raise CheckpointError(f"{path} is packed store format version {doc['version']}, which this localmoe "
                                  f"no longer reads (it reads {VERSION}); convert the model again")
        if doc.get("alignment") != ALIGN or doc.get("checksum") != CHECKSUM:
            raise bad(f"alignment must be {ALIGN} and checksum {CHECKSUM!r}")
        for key, kind in [("model_spec", dict), ("files", list), ("dense", dict), ("expert_layouts", dict),
                          ("experts", list)]:
            if not isinstance(doc.get(key), kind):
                raise bad(f"field {key!r} is missing or not a JSON {kind.__name__}")
        dense = doc["dense"]
        if not isinstance(dense.get("shards"), list) or not isinstance(dense.get("tensors"), dict):
            raise bad("field 'dense' needs a list 'shards' and an object 'tensors'")
        files = [_file_record(r, f"files[{i}]", bad) for i, r in enumerate(doc["files"])]
        shards = [_file_record(r, f"dense.shards[{i}]", bad) for i, r in enumerate(dense["shards"])]
        by_file = {s.file: s for s in shards}
        for name, file in dense["tensors"].items():
            if file not in by_file:
                raise bad(f"dense tensor {name!r} is in {file!r}, which is not a listed shard")
            by_file[file].tensors.append(name)
        layouts = {}
        for name, data in doc["expert_layouts"].items():
            try:
                layouts[name] = ExpertLayout.from_dict(data)
            except ValueError as e:
                raise bad(f"expert layout {name!r} {e}") from None
        layers = [_layer_record(r, f"experts[{i}]", layouts, bad) for i, r in enumerate(doc["experts"])]
        if len({r.layer for r in layers}) != len(layers):
            raise bad("a layer appears twice in 'experts'")
        limit = _layer_limit(doc["model_spec"])
        if limit is not None and any(r.layer >= limit for r in layers):
            raise bad(f"'experts' lists layer {max(r.layer for r in layers)}, past the model's layers and its "
                      f"next-n (MTP) layers ({limit})")
        return cls(doc["model_spec"], files, shards, layouts, layers)


def _layer_limit(model_spec: dict) -> int | None:
    """Expert layers a store may hold: the model's (`num_layers`) and, after them, its next-n (MTP) layers
    (`nextn_layers`); None where the spec does not say (its own checks are checkpoint.store_spec's)."""
    layers, nextn = model_spec.get("num_layers"), model_spec.get("nextn_layers", 0)
    return layers + nextn if type(layers) is int and type(nextn) is int else None


def _pretty(obj: object, pad: str = "") -> str:
    """JSON indented by 2, with any value that fits in 100 columns on one line."""
    flat = json.dumps(obj)
    if len(pad) + len(flat) <= 100 or not isinstance(obj, (dict, list)) or not obj:
        return flat
    inner = pad + "  "
    if isinstance(obj, dict):
        items = [f"{inner}{json.dumps(k)}: {_pretty(v, inner)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    return "[\n" + ",\n".join(inner + _pretty(v, inner) for v in obj) + "\n" + pad + "]"


def _file_record(r: object, where: str, bad) -> FileRecord:
    if not (isinstance(r, dict) and _relative(r.get("file")) and type(r.get("nbytes")) is int and r["nbytes"] >= 0
            and isinstance(r.get(CHECKSUM), str) and _HEX64.fullmatch(r[CHECKSUM])
            and isinstance(r.get("role", ""), str)):
        raise bad(f"{where} needs a relative 'file', an integer 'nbytes' and a 16-hex-digit '{CHECKSUM}'")
    return FileRecord(r["file"], r["nbytes"], r[CHECKSUM], r.get("role", ""))


def _layer_record(r: object, where: str, layouts: dict, bad) -> LayerRecord:
    ok = (isinstance(r, dict) and type(r.get("layer")) is int and r["layer"] >= 0 and _relative(r.get("file"))
          and r.get("layout") in layouts and isinstance(r.get("experts"), list) and isinstance(r.get(CHECKSUM), list))
    if not ok:
        raise bad(f"{where} needs an integer 'layer', a relative 'file', a known 'layout' and lists 'experts' "
                  f"and '{CHECKSUM}'")
    experts, sums = r["experts"], r[CHECKSUM]
    if (len(experts) != len(sums) or not all(type(e) is int and e >= 0 for e in experts)
            or len(set(experts)) != len(experts)
            or not all(isinstance(s, str) and _HEX64.fullmatch(s) for s in sums)):
        raise bad(f"{where} (layer {r['layer']}) needs distinct expert ids and one 16-hex-digit checksum each")
    return LayerRecord(r["layer"], r["file"], r["layout"], experts, sums)


def _relative(name: object) -> bool:
    return isinstance(name, str) and bool(name) and not name.startswith("/") and ".." not in name.split("/")


# ---- the resume journal ----

@dataclass(slots=True)
class Progress:
    """What earlier runs completed: files renamed into place, with their checksums."""

    resume_key: str
    shard_bytes: int
    layouts: dict[str, ExpertLayout] = field(default_factory=dict)
    dense_shards: list[FileRecord] = field(default_factory=list)
    layers: dict[int, LayerRecord] = field(default_factory=dict)
    files: dict[str, FileRecord] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({
            "format": PROGRESS_FORMAT, "version": VERSION, "resume_key": self.resume_key,
            "shard_bytes": self.shard_bytes,
            "layouts": {name: layout.to_dict() for name, layout in self.layouts.items()},
            "dense_shards": [{**s.to_dict(), "tensors": s.tensors} for s in self.dense_shards],
            "layers": [r.to_dict() for r in self.layers.values()],
            "files": [f.to_dict() for f in self.files.values()]})

    @classmethod
    def load(cls, path: Path) -> Progress | None:
        """The journal at `path`, or None when there is none or it cannot be used."""
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            if doc["format"] != PROGRESS_FORMAT or doc["version"] != VERSION:
                return None

            def bad(what: str) -> ValueError:
                return ValueError(what)

            layouts = {name: ExpertLayout.from_dict(d) for name, d in doc["layouts"].items()}
            shards = []
            for i, d in enumerate(doc["dense_shards"]):
                shards.append(_file_record(d, "", bad))
                shards[-1].tensors = [str(t) for t in d["tensors"]]
            layers = [_layer_record(d, "", layouts, bad) for d in doc["layers"]]
            files = [_file_record(d, "", bad) for d in doc["files"]]
            return cls(str(doc["resume_key"]), int(doc["shard_bytes"]), layouts, shards,
                       {r.layer: r for r in layers}, {f.file: f for f in files})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None


# ---- durable writes ----

def fsync_dir(path: Path) -> None:
    """Make renames and unlinks inside directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: write `path.partial`, fsync, rename over `path`, fsync the directory."""
    partial = path.with_name(path.name + PARTIAL)
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    fsync_dir(path.parent)
