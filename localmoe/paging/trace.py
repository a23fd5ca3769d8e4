"""Routing traces: which experts each token chose in each MoE layer.

A `RoutingTrace` is filled by the router hooks (`paging.hooks.attach(model, trace=t)`)
during generation, or made up by `synthetic_trace` (labelled synthetic: random-weight
test models route almost uniformly, so locality has to be modelled to say anything about
real models). `accesses()` turns it into the demand sequence the pager sees: per forward
pass, per layer, each chosen expert once in ascending id (the MoE dispatch order).

File format (JSON): {"format": "localmoe-trace", "version": 1, "label", "synthetic",
"num_experts", "top_k", "layers", "steps": [{"tokens": N, "layers": {L: [[e, ...] x N]}}]}.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from localmoe.paging.errors import PagingError

FORMAT, VERSION = "localmoe-trace", 1


@dataclass
class RoutingTrace:
    num_experts: int = 0
    top_k: int = 0
    label: str = ""
    synthetic: bool = False
    steps: list[dict[int, list[list[int]]]] = field(default_factory=list)  # step -> layer -> [N][k]
    _last_layer: int | None = None

    def record(self, layer: int, ids) -> None:
        """ids [N, k] of one MoE layer in one forward pass (a tensor or nested lists)."""
        rows = ids.tolist() if hasattr(ids, "tolist") else [list(r) for r in ids]
        if not self.steps or (self._last_layer is not None and layer <= self._last_layer):
            self.steps.append({})
        self._last_layer = layer
        self.steps[-1][layer] = [[int(e) for e in r] for r in rows]
        self.top_k = self.top_k or (len(rows[0]) if rows else 0)

    @property
    def layers(self) -> list[int]:
        return sorted({layer for step in self.steps for layer in step})

    @property
    def tokens(self) -> int:
        return sum(len(next(iter(s.values()))) for s in self.steps if s)

    def accesses(self) -> list[tuple[int, tuple[int, int]]]:
        """(step, (layer, expert)) in the order the pager is asked for them."""
        out = []
        for t, step in enumerate(self.steps):
            for layer in sorted(step):
                for e in sorted({e for row in step[layer] for e in row}):
                    out.append((t, (layer, e)))
        return out

    def keys(self) -> list[tuple[int, int]]:
        return [key for _, key in self.accesses()]

    def decode_only(self) -> RoutingTrace:
        """Drop multi-token steps (prefill), keeping token-by-token decode."""
        return RoutingTrace(self.num_experts, self.top_k, self.label, self.synthetic,
                            [s for s in self.steps if s and len(next(iter(s.values()))) == 1])

    def reuse(self) -> float:
        """Mean fraction of a layer's experts that the next step chose again (decode steps)."""
        same = total = 0
        for prev, cur in zip(self.steps, self.steps[1:]):
            for layer, rows in cur.items():
                if layer in prev and len(rows) == 1 and len(prev[layer]) == 1:
                    same += len(set(rows[0]) & set(prev[layer][0]))
                    total += len(rows[0])
        return same / total if total else 0.0

    def popularity(self) -> dict[int, np.ndarray]:
        """layer -> how many times each expert was chosen."""
        counts = {}
        for step in self.steps:
            for layer, rows in step.items():
                c = counts.setdefault(layer, np.zeros(self.num_experts, dtype=np.int64))
                for row in rows:
                    np.add.at(c, row, 1)
        return counts

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "label": self.label, "synthetic": self.synthetic,
                "num_experts": self.num_experts, "top_k": self.top_k, "layers": self.layers,
                "steps": [{"tokens": len(next(iter(s.values()))) if s else 0,
                           "layers": {str(k): v for k, v in s.items()}} for s in self.steps]}

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), separators=(",", ":")) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> RoutingTrace:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PagingError(f"{path}: cannot read the routing trace ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            raise PagingError(f"{path} is not a localmoe routing trace (version {VERSION}); record one with "
                              f"`localmoe trace`")
        steps = [{int(k): v for k, v in s["layers"].items()} for s in data["steps"]]
        return cls(data["num_experts"], data["top_k"], data.get("label", ""), bool(data.get("synthetic")), steps)


def _zipf_weights(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


def _draw(rng, layers, ranks, weights, top_k, tokens, p) -> list[dict[int, list[list[int]]]]:
    num_experts = len(weights)
    steps, prev = [], {}
    for _ in range(tokens):
        step = {}
        for layer in layers:
            chosen = [e for e in prev.get(layer, []) if rng.random() < p][:top_k]
            while len(chosen) < top_k:
                e = int(ranks[layer][rng.choice(num_experts, p=weights)])
                if e not in chosen:
                    chosen.append(e)
            step[layer] = [chosen]
            prev[layer] = chosen
        steps.append(step)
    return steps


def synthetic_trace(layers: list[int], num_experts: int, top_k: int, tokens: int, reuse: float = 0.30,
                    zipf: float = 1.0, seed: int = 0, draws: int | None = None) -> RoutingTrace:
    """A SYNTHETIC decode trace with the locality reported for real MoE models (MODELS.md):
    about `reuse` of a layer's experts chosen again by the next token, and popularity
    Zipf-skewed with exponent `zipf` (a random rank order per layer).

    Each of the previous token's experts is kept with probability p, the rest drawn from
    the Zipf popularity; p is found by bisection on pilot traces so that the measured
    reuse (chance repeats of popular experts included) is `reuse`.

    `seed` makes the model (each layer's popularity order); `draws`, when given, seeds the
    routing separately, so two traces with one `seed` and different `draws` are two runs of
    the same model (e.g. a calibration run and the run it is meant for).
    """
    rng = np.random.default_rng(seed)
    weights = _zipf_weights(num_experts, zipf)
    ranks = {layer: rng.permutation(num_experts) for layer in layers}
    lo, hi = 0.0, 1.0
    for _ in range(10):
        mid = (lo + hi) / 2
        pilot = RoutingTrace(num_experts, top_k,
                             steps=_draw(np.random.default_rng(seed + 1), [0], {0: ranks[layers[0]]}, weights,
                                         top_k, 300, mid))
        lo, hi = (mid, hi) if pilot.reuse() < reuse else (lo, mid)
    trace = RoutingTrace(num_experts, top_k, f"synthetic: ~{reuse:.0%} next-token reuse, Zipf s={zipf}", True)
    trace.steps = _draw(rng if draws is None else np.random.default_rng([seed, draws]), layers, ranks, weights,
                        top_k, tokens, (lo + hi) / 2)
    return trace
