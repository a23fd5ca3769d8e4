"""`convert`: rewrite a checkpoint (HF safetensors directory or GGUF file) as a packed store.

Streaming: every tensor is mapped on its own while it is written (sources.py), dense
ones through `add_dense_lazy`, experts one extent at a time (experts.py), so memory
stays near the largest tensor. Atomic and resumable through PackedStoreWriter's journal;
the resume key digests the source's identity and the options, so a changed source or
option starts over. Quantisation errors of finished layers are journalled beside it
(`.conversion-errors.jsonl`) and end up in `conversion-report.json`. See docs/convert.md.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from localmoe.convert.experts import (
    ERROR_BOUND,
    ExpertSource,
    add_to_record,
    describe,
    new_record,
    summarize,
)
from localmoe.convert.sources import GGUF_TENSORS_FILE, ReadAhead, Source, SourceFiles, TensorRef, open_source
from localmoe.errors import CheckpointError, LocalMoEError
from localmoe.quant import mxfp4
from localmoe.store.manifest import MANIFEST, PARTIAL, PROGRESS, write_atomic
from localmoe.store.packed_writer import DENSE_SHARD_BYTES, PackedStoreWriter

CONVERTER_VERSION = 1  # part of the resume key: bump when the same inputs would give other bytes
REPORT_FILE = "conversion-report.json"
ERRORS_JOURNAL = ".conversion-errors.jsonl"
QUANTIZE_THREADS = min(8, os.cpu_count() or 1)  # 2 threads on 2 cores: 1.5x one (torch releases the GIL)
IN_FLIGHT = 2 * QUANTIZE_THREADS  # experts mapped and being prepared ahead of the one written

Progress = Callable[[int, int], object]  # (bytes read so far in this run, bytes this run reads)
Log = Callable[[str], object]


@dataclass
class ConversionResult:
    path: Path
    report: dict
    bytes_read: int  # source bytes read by this run (less than the source when resuming)
    seconds: float


def resume_key(source: Source, experts: str) -> str:
    return (f"localmoe-convert/{CONVERTER_VERSION} {source.kind} {source.identity} experts={experts} "
            f"scale_rule={mxfp4.DEFAULT_SCALE_RULE}")


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, experts: str = "mxfp4", overwrite: bool = False,
            shard_bytes: int = DENSE_SHARD_BYTES, progress: Progress | None = None,
            log: Log | None = None) -> ConversionResult:
    """Convert checkpoint `src` into the packed store `dst`; an interrupted run resumes.

    experts: "mxfp4" quantises bf16/f16/fp8 routed experts to MXFP4 (MXFP4 sources are
    repacked losslessly either way); "keep" stores them as they are.
    """
    started = time.perf_counter()
    source = open_source(src)
    dst = Path(dst)
    _check_destination(source, dst, overwrite)
    experts_in = ExpertSource(source, experts)
    key = resume_key(source, experts)
    files = SourceFiles()
    job = _Job(source, experts_in, files, progress or (lambda done, total: None), log or (lambda line: None))
    try:
        with PackedStoreWriter(dst, resume_key=key, shard_bytes=shard_bytes, overwrite=overwrite) as w:
            w.set_spec(source.spec)
            for path, name, role in source.files:
                w.add_file(path, name, role)
            for data, name, role in source.generated:
                w.add_file_bytes(data, name, role)
            dense = job.plan(w)
            job.write_dense(w, dense)
            records = job.write_experts(w, _ErrorJournal(dst / ERRORS_JOURNAL, key))
            report = _report(source, experts_in, key, dense, records)
            w.add_file_bytes(_report_json(report), REPORT_FILE, "conversion_report")
    except OSError as e:
        raise LocalMoEError(f"converting into {dst} failed: {e.strerror or e} ({e.filename or dst}); fix that and "
                            f"run the same command again to resume") from None
    finally:
        files.close()
    (dst / ERRORS_JOURNAL).unlink(missing_ok=True)
    return ConversionResult(dst, report, job.done, time.perf_counter() - started)


def _check_destination(source: Source, dst: Path, overwrite: bool) -> None:
    if dst.resolve() == source.path.resolve():
        raise CheckpointError(f"{dst}: the packed store must go to another directory than the source")
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{dst} exists and is not a directory")
    if (dst / MANIFEST).exists() and not overwrite:
        raise CheckpointError(f"{dst} already holds a packed store; pass --overwrite to replace it")
    if not dst.is_dir() or (dst / MANIFEST).exists() or (dst / PROGRESS).exists():
        return
    # no journal yet: only files a conversion writes before its first journal entry may be there
    ours = {PROGRESS, ERRORS_JOURNAL, REPORT_FILE, "experts", *(n for _, n, _ in source.files),
            *(n for _, n, _ in source.generated)}
    foreign = [p.name for p in dst.iterdir() if p.name not in ours and not p.name.endswith(PARTIAL)]
    if foreign:
        raise CheckpointError(f"{dst} is not empty and not a packed store (it holds {foreign[0]!r}); convert into a "
                              f"new directory")


class _Job:
    """One conversion run: reads in order, counts bytes, logs."""

    def __init__(self, source: Source, experts: ExpertSource, files: SourceFiles, progress: Progress,
                 log: Log) -> None:
        self.source, self.experts, self.files, self.progress, self.log = source, experts, files, progress, log
        self.done = self.total = 0
        self.todo_layers: list[int] = []  # MoE layers not finished by an earlier run

    def tick(self, nbytes: int) -> None:
        self.done += nbytes
        self.progress(self.done, self.total)

    def plan(self, w: PackedStoreWriter) -> list[TensorRef]:
        """Dense tensors in write order; sets the bytes this run will read."""
        # widest dtype first, as the writer orders a shard, so tensors are read in the order added
        dense = sorted((r for r in self.source.tensors.values() if r.name not in self.experts.names),
                       key=lambda r: -r.dtype.itemsize)
        self.todo_layers = [layer for layer in self.experts.layers if not w.layer_done(layer)]
        self.total = sum(r.nbytes for r in dense if not w.dense_done(r.name))
        self.total += sum(self._layer_bytes(layer) for layer in self.todo_layers)
        self.progress(0, self.total)
        return dense

    def _layer_bytes(self, layer: int) -> int:
        """Source bytes of one MoE layer's experts (all alike, as the writer demands)."""
        return self.experts.num_experts * sum(r.nbytes for rs in self.experts.refs(layer, 0).values() for r in rs)

    def write_dense(self, w: PackedStoreWriter, dense: list[TensorRef]) -> None:
        ahead = ReadAhead(self.files, [r for r in dense if not w.dense_done(r.name)])
        previous: list[TensorRef] = []

        def load(ref: TensorRef):
            ahead.release(previous)  # the writer is done with the previous tensor
            previous[:] = [ref]
            self.tick(ref.nbytes)
            return ahead.take(ref)

        for ref in dense:
            w.add_dense_lazy(ref.name, ref.dtype, ref.shape, lambda ref=ref: load(ref))
        w.flush_dense()
        ahead.release(previous)

    def _expert_refs(self, layers: list[int]) -> Iterator[TensorRef]:
        for layer in layers:
            for e in range(self.experts.num_experts):
                for refs in self.experts.refs(layer, e).values():
                    yield from refs

    def _layer(self, layer: int, ahead: ReadAhead, pool: ThreadPoolExecutor) -> Iterator[tuple[int, dict, dict]]:
        """(expert, parts, errors) of each expert of `layer` in order, with IN_FLIGHT experts
        prepared ahead by `pool` (quantisation runs in torch, which releases the GIL)."""
        pending: deque = deque()
        upcoming = iter(range(self.experts.num_experts))

        def submit(e: int) -> None:
            refs = self.experts.refs(layer, e)
            tensors = {proj: [ahead.take(r) for r in rs] for proj, rs in refs.items()}
            pending.append((e, [r for rs in refs.values() for r in rs],
                            pool.submit(self.experts.parts, layer, e, tensors)))

        for e in itertools.islice(upcoming, IN_FLIGHT):
            submit(e)
        while pending:
            e, refs, future = pending.popleft()
            parts, errors = future.result()
            del future
            if (nxt := next(upcoming, None)) is not None:
                submit(nxt)
            yield e, parts, errors
            del parts
            ahead.release(refs)
            self.tick(sum(r.nbytes for r in refs))

    def write_experts(self, w: PackedStoreWriter, journal: _ErrorJournal) -> list[dict]:
        ex = self.experts
        records = journal.load(w) if ex.quantises else {}
        ahead = ReadAhead(self.files, self._expert_refs(self.todo_layers))
        with ThreadPoolExecutor(max_workers=QUANTIZE_THREADS if ex.quantises else 1) as pool:
            for layer in ex.layers:
                if w.layer_done(layer):
                    if ex.quantises and layer not in records:  # finished just before an interruption
                        self.log(f"layer {layer}: measuring its quantisation error again (the layer was "
                                 f"finished just before the interruption)")
                        self.total += self._layer_bytes(layer)
                        records[layer] = self._record(layer, None, pool)
                        journal.append(records[layer])
                    continue
                record = self._record(layer, w, pool, ahead)
                w.finish_layer()
                if ex.quantises:
                    records[layer] = record
                    journal.append(record)
                    self.log(f"layer {layer}: {ex.num_experts} experts quantised to MXFP4, "
                             f"{describe(summarize([record]))}")
                else:
                    self.log(f"layer {layer}: {ex.num_experts} experts "
                             f"{ex.stored_format.replace('mxfp4-', 'MXFP4 ')}")
        return [records[layer] for layer in sorted(records)]

    def _record(self, layer: int, w: PackedStoreWriter | None, pool: ThreadPoolExecutor,
                ahead: ReadAhead | None = None) -> dict:
        """Write `layer`'s experts (w=None: only measure them); returns its error record."""
        record = new_record(layer)
        ahead = ahead or ReadAhead(self.files, self._expert_refs([layer]))
        for e, parts, errors in self._layer(layer, ahead, pool):
            if w is not None:
                w.add_expert(layer, e, parts)
            del parts
            add_to_record(record, e, errors)
        return record


class _ErrorJournal:
    """Quantisation errors of finished layers, one JSON line each, so a resumed run need not
    quantise kept layers again. Lines of another resume key, or torn by a crash, are ignored."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key

    def load(self, w: PackedStoreWriter) -> dict[int, dict]:
        records: dict[int, dict] = {}
        if self.path.exists():
            for line in self.path.read_bytes().splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if isinstance(entry, dict) and entry.get("key") == self.key and w.layer_done(entry["layer"]):
                    records[entry["layer"]] = entry["record"]
        write_atomic(self.path, b"".join(self._line(r) for r in records.values()))
        return records

    def _line(self, record: dict) -> bytes:
        return json.dumps({"key": self.key, "layer": record["layer"], "record": record}).encode() + b"\n"

    def append(self, record: dict) -> None:
        with open(self.path, "ab") as f:
            f.write(self._line(record))
            f.flush()
            os.fsync(f.fileno())


def _report(source: Source, ex: ExpertSource, key: str, dense: list[TensorRef], records: list[dict]) -> dict:
    """conversion-report.json: deterministic (no times, no absolute paths), so a resumed
    conversion writes the same bytes as an uninterrupted one."""
    expert_bytes = sum(source.tensors[n].nbytes for n in ex.names)
    report = {
        "format": "localmoe-conversion-report", "version": 1,
        "source": {"kind": source.kind, "model_type": source.spec.model_type, "family": source.family.name,
                   "files": [{"file": p.name, "nbytes": p.stat().st_size} for p in source.weight_files]},
        "options": {"experts": ex.mode},
        "resume_key": key,
        "dense": {"tensors": len(dense), "nbytes": sum(r.nbytes for r in dense), "lossless": True},
        "experts": {"source_format": ex.decl.format if ex.decl else None, "stored": ex.stored_format,
                    "lossless": not ex.quantises, "layers": ex.layers,
                    "experts_per_layer": ex.num_experts if ex.layers else 0, "source_nbytes": expert_bytes},
    }
    if source.kind == "gguf":
        report["dense"]["ggml_types"] = GGUF_TENSORS_FILE
    if ex.quantises:
        report["quantization"] = {
            "format": "mxfp4", "scale_rule": mxfp4.DEFAULT_SCALE_RULE,
            "error_bound": f"|x_hat - x| <= {ERROR_BOUND} per element (amax: max |x| of its 32-value block)",
            "summary": summarize(records),
            "layers": [{**summarize([r]), **r} for r in records],
        }
    return report


def _report_json(report: dict) -> bytes:
    """Indented JSON with each layer's error record on one line (DeepSeek: 58 lines, not 100k)."""
    quant = report.get("quantization")
    if quant is None:
        return json.dumps(report, indent=1).encode()
    text = json.dumps({**report, "quantization": {**quant, "layers": "@LAYERS@"}}, indent=1)
    layers = "[\n" + ",\n".join("   " + json.dumps(r) for r in quant["layers"]) + "\n  ]"
    return text.replace('"@LAYERS@"', layers).encode()
