"""Held tables: one MoE layer's expert table for the kernels, over experts that change from call to call.

A paging provider hands a layer's chosen experts out together (`hold`: views of its RAM slots, valid until its
next call); `fill` points the table's rows at them and zeroes the rest, so the layer runs in ONE kernel call as a
resident layer does, with the same bits: the kernels add experts in increasing id either way.
- `HeldTable`: MXFP4 experts for `mxfp4_moe` (`ExpertTable`'s interface).
- `HeldDenseTable`: dense fp32 / bf16 experts for the fused step's `dense_experts_token` (kernels/decode_layers
  hybrid.py), the loop a resident `DenseExpertTable` layer runs inside the step.
- `HeldBlockTable`: GGUF-block experts for `ggml_moe_token` (kernels/ggml_gemv/experts.py), as a resident
  `BlockExpertTable` layer runs inside the step.
A pager hands out the same weights object for a slot every time (its memory never moves), so each expert's row
is computed once per weights object and kept.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from localmoe.kernels.dense_moe import DenseExpertTable
from localmoe.kernels.ggml_gemv.experts import BlockExpertTable
from localmoe.kernels.mxfp4_moe import ExpertTable

ROWS_KEPT = 1 << 16  # rows kept per table, cleared when full


class _Held:
    """int64 `addresses` [E, width] with a row per expert of the last `fill`, 0 elsewhere; `_row(w)` gives an
    expert's (row, form) or None where the kernel cannot take it; every expert of one fill has the same form."""

    width = 0

    def __init__(self, num_experts: int):
        self.addresses = torch.zeros(num_experts, self.width, dtype=torch.int64)
        self._rows = self.addresses.numpy()
        self.device = torch.device("cpu")
        self.hidden = self.intermediate = 0
        self.form = None
        self.experts: dict[int, object] = {}
        self._kept: dict[int, tuple[object, np.ndarray, tuple]] = {}  # id(weights) -> (weights, row, form)

    def _row(self, w) -> tuple[list[int], tuple] | None:
        raise NotImplementedError

    def _set_form(self, form: tuple) -> None:
        self.form = form

    def fill(self, experts: Mapping[int, object]) -> bool:
        """Rows for `experts` (id -> weights), every other row 0. False (the table then holds nothing) where one is
        not in the kernel's form, or their forms differ."""
        for e in self.experts:
            self._rows[e] = 0
        self.experts = {}
        form = None
        for e, w in experts.items():
            kept = self._kept.get(id(w))
            if kept is None or kept[0] is not w:  # (a kept entry holds its weights: no other object has that id)
                row = self._row(w)
                if row is None:
                    return self._clear()
                if len(self._kept) >= ROWS_KEPT:
                    self._kept.clear()
                kept = self._kept[id(w)] = (w, np.array(row[0], dtype=np.int64), row[1])
            if form is None:
                form = kept[2]
            elif kept[2] != form:
                return self._clear()
            self._rows[e] = kept[1]
        self.experts = dict(experts)
        if form is not None:
            self._set_form(form)
        return True

    def _clear(self) -> bool:
        self._rows[:] = 0
        self.experts = {}
        return False


class HeldTable(_Held):
    """`ExpertTable`'s interface (addresses int64 [E, 9], intermediate, device, experts, grouped) over the MXFP4
    experts of the last `fill` (CPU, the kernels' form, no biases: `ExpertTable.holds`)."""

    width = 9
    grouped = None

    def _row(self, w):
        g, u, d = w.gate, w.up, w.down
        if g.packed is None or g.bias is not None or u.bias is not None or d.bias is not None or \
                not ExpertTable.holds(w) or u.packed.shape != g.packed.shape or \
                d.packed.shape != (g.packed.shape[1] * 2, g.packed.shape[0] // 2):
            return None
        return ExpertTable.row(w)[0], (g.packed.shape[0], d.packed.shape[0])

    def _set_form(self, form: tuple) -> None:
        self.form = form
        self.intermediate, self.hidden = form


def _plain(w) -> bool:
    return all(p.bias is None and p.packed is None for p in (w.gate, w.up, w.down))


class HeldDenseTable(_Held):
    """Dense experts (gate [I, W], up [I, W], down [W, I], all fp32 or all bf16, contiguous, CPU, no biases:
    `DenseExpertTable.of`): addresses int64 [E, 3], `dtype`, `intermediate`, `hidden`."""

    width = 3
    dtype = None

    def _row(self, w):
        mats = (w.gate.weight, w.up.weight, w.down.weight)
        if not _plain(w) or DenseExpertTable.of([mats]) is None:
            return None
        return [m.data_ptr() for m in mats], (mats[0].dtype, *mats[0].shape)

    def _set_form(self, form: tuple) -> None:
        self.form = form
        self.dtype, self.intermediate, self.hidden = form


class HeldBlockTable(_Held):
    """GGUF-block experts (one kernel type per projection, whole blocks, CPU, no biases: `BlockExpertTable.of`):
    `BlockExpertTable`'s interface for `ggml_moe_token` (addresses int64 [E, 3], types, type_codes, intermediate,
    hidden)."""

    width = 3
    types = ()
    type_codes = torch.zeros(3, dtype=torch.int64)

    def _row(self, w):
        mats = (w.gate.weight, w.up.weight, w.down.weight)
        if any(p.bias is not None for p in (w.gate, w.up, w.down)) or BlockExpertTable.of([mats]) is None:
            return None
        return [m.raw.data_ptr() for m in mats], (tuple(m.ggml_type for m in mats), *mats[0].shape)

    def _set_form(self, form: tuple) -> None:
        if form != self.form:
            self.types, self.intermediate, self.hidden = form[0], form[1], form[2]
            self.type_codes = torch.tensor([int(t) for t in self.types], dtype=torch.int64)
        self.form = form
