"""`HeldTable`: one MoE layer's expert table for `mxfp4_moe` over experts that change from call to call.

A paging provider hands a layer's chosen experts out together (`hold`: views of its RAM slots, valid until its
next call); `fill` points the table's rows at them and zeroes the rest, so the layer runs in ONE kernel call as a
resident layer does (`ExpertTable`), with the same bits: the kernel adds experts in increasing id either way.
A pager hands out the same weights object for a slot every time (its memory never moves), so each expert row
is computed once per weights object and kept.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from localmoe.kernels.mxfp4_moe import ExpertTable

ROWS_KEPT = 1 << 16  # rows kept per table, cleared when full


class HeldTable:
    """`ExpertTable`'s interface (addresses int64 [E, 9], intermediate, device, experts, grouped) over the experts
    of the last `fill`."""

    def __init__(self, num_experts: int):
        self.addresses = torch.zeros(num_experts, 9, dtype=torch.int64)
        self._rows = self.addresses.numpy()
        self.device, self.grouped = torch.device("cpu"), None
        self.hidden = self.intermediate = 0
        self.experts: dict[int, object] = {}
        self._kept: dict[int, tuple[object, np.ndarray, tuple]] = {}  # id(weights) -> (weights, row, widths)

    def fill(self, experts: Mapping[int, object]) -> bool:
        """Rows for `experts` (id -> weights), every other row 0. False (the table then holds nothing) where one is
        not an MXFP4 CPU expert in the kernels' form without a bias (`ExpertTable.holds`), or their widths differ."""
        for e in self.experts:
            self._rows[e] = 0
        self.experts = {}
        width = None
        for e, w in experts.items():
            kept = self._kept.get(id(w))
            if kept is None or kept[0] is not w:  # (a kept entry holds its weights: no other object has that id)
                g, u, d = w.gate, w.up, w.down
                if g.packed is None or g.bias is not None or u.bias is not None or d.bias is not None or \
                        not ExpertTable.holds(w) or u.packed.shape != g.packed.shape or \
                        d.packed.shape != (g.packed.shape[1] * 2, g.packed.shape[0] // 2):
                    return self._clear()
                if len(self._kept) >= ROWS_KEPT:
                    self._kept.clear()
                kept = self._kept[id(w)] = (w, np.array(ExpertTable.row(w)[0], dtype=np.int64),
                                            (g.packed.shape[0], d.packed.shape[0]))
            if width is None:
                width = kept[2]
            elif kept[2] != width:
                return self._clear()
            self._rows[e] = kept[1]
        self.experts = dict(experts)
        if width is not None:
            self.intermediate, self.hidden = width
        return True

    def _clear(self) -> bool:
        self._rows[:] = 0
        self.experts = {}
        return False
