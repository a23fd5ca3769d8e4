"""Tile tables of a grouped expert matmul, built on the device (no host sync, capturable in a CUDA graph).

Rows m of x go through expert ids[m]. In stable sorted order (by expert, then row), each expert's rows
are cut into tiles of at most `block_n` rows; tile t is described by
    tile_start[t]   its first sorted position (M for a tile past the real count: the program exits)
    tile_expert[t]  its expert
and the kernels read `rows[p]` (the original row at sorted position p) and `sorted_ids[p]` (its expert)
for p in [tile_start, tile_start + block_n), masking positions whose expert differs. Tiles are numbered
by (expert, first rank), so both builders below give the same tables.

The number of tiles is at most `max_tiles(M, E, block_n)`, known from shapes alone: the launch grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PLAN_MAX_ROWS = 1024  # rows up to which the one-program Triton builder runs (O(M^2) compares, ~M^2/64 steps)
CHUNK = 64


def max_tiles(M: int, E: int, block_n: int) -> int:
    """Upper bound on sum_e ceil(count_e / block_n) over E experts and M rows."""
    return min(M, M // block_n + min(E, M))


@triton.jit
def _plan_kernel(ids_ptr, rows_ptr, sorted_ids_ptr, scratch_ptr, tile_start_ptr, tile_expert_ptr, M, T_MAX,
                 BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    lane = tl.arange(0, CHUNK)
    for t0 in range(0, T_MAX, CHUNK):  # every tile empty until written below
        tl.store(tile_start_ptr + t0 + lane, M + lane * 0, mask=t0 + lane < T_MAX)
    for i0 in range(0, M, CHUNK):  # stable sorted position = rows of smaller experts + rank among its own
        i = i0 + lane
        mi = i < M
        e = tl.load(ids_ptr + i, mask=mi, other=0).to(tl.int32)
        less = tl.zeros((CHUNK,), dtype=tl.int32)
        rank = tl.zeros((CHUNK,), dtype=tl.int32)
        for j0 in range(0, M, CHUNK):
            j = j0 + lane
            mj = (j < M)[None, :]
            f = tl.load(ids_ptr + j, mask=j < M, other=0).to(tl.int32)[None, :]
            less += tl.sum((mj & (f < e[:, None])).to(tl.int32), axis=1)
            rank += tl.sum((mj & (f == e[:, None]) & (j[None, :] < i[:, None])).to(tl.int32), axis=1)
        pos = less + rank
        tl.store(rows_ptr + pos, i, mask=mi)
        tl.store(sorted_ids_ptr + pos, e, mask=mi)
        tl.store(scratch_ptr + i, rank, mask=mi)
        tl.store(scratch_ptr + M + i, pos, mask=mi)
    tl.debug_barrier()  # ranks of every row written (and the empty tiles) before they are read
    for i0 in range(0, M, CHUNK):  # tile of a first row = first rows of smaller experts + rank // BLOCK_N
        i = i0 + lane
        mi = i < M
        e = tl.load(ids_ptr + i, mask=mi, other=0).to(tl.int32)
        rank = tl.load(scratch_ptr + i, mask=mi, other=1)
        before = tl.zeros((CHUNK,), dtype=tl.int32)
        for j0 in range(0, M, CHUNK):
            j = j0 + lane
            mj = j < M
            f = tl.load(ids_ptr + j, mask=mj, other=0).to(tl.int32)
            first = mj & (tl.load(scratch_ptr + j, mask=mj, other=1) % BLOCK_N == 0)
            before += tl.sum((first[None, :] & (f[None, :] < e[:, None])).to(tl.int32), axis=1)
        starts = mi & (rank % BLOCK_N == 0)
        tile = before + rank // BLOCK_N
        tl.store(tile_start_ptr + tile, tl.load(scratch_ptr + M + i, mask=mi, other=0), mask=starts)
        tl.store(tile_expert_ptr + tile, e, mask=starts)


def _launch(kernel, grid, *args, **consts) -> None:
    """Every kernel launch of the MXFP4 wrappers goes through here (tests watch what happens around it)."""
    kernel[grid](*args, **consts)


def plan_triton(ids: torch.Tensor, E: int, block_n: int) -> tuple[torch.Tensor, ...]:
    """(rows, sorted_ids, tile_start, tile_expert), int32, in one single-program kernel; M <= PLAN_MAX_ROWS."""
    M = ids.shape[0]
    T = max_tiles(M, E, block_n)
    i32 = {"dtype": torch.int32, "device": ids.device}
    rows, sorted_ids, scratch = torch.empty(M, **i32), torch.empty(M, **i32), torch.empty(2 * M, **i32)
    tile_start, tile_expert = torch.empty(T, **i32), torch.zeros(T, **i32)
    _launch(_plan_kernel, (1,), ids, rows, sorted_ids, scratch, tile_start, tile_expert, M, T,
            BLOCK_N=block_n, CHUNK=CHUNK)
    return rows, sorted_ids, tile_start, tile_expert


def plan_torch(ids: torch.Tensor, E: int, block_n: int) -> tuple[torch.Tensor, ...]:
    """The same tables from torch ops without a host sync (any M: prefill)."""
    M = ids.shape[0]
    T = max_tiles(M, E, block_n)
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids.index_select(0, order)
    positions = torch.arange(M, device=ids.device)
    rank = positions - torch.searchsorted(sorted_ids, sorted_ids)  # rank within its expert's rows
    starts = rank % block_n == 0
    tile = torch.where(starts, torch.cumsum(starts, 0) - 1, T)  # row T: a dump for the other positions
    tile_start = torch.full((T + 1,), M, dtype=torch.int32, device=ids.device)
    tile_expert = torch.zeros(T + 1, dtype=torch.int32, device=ids.device)
    tile_start.index_put_((tile,), positions.to(torch.int32))
    tile_expert.index_put_((tile,), sorted_ids.to(torch.int32))
    return order.to(torch.int32), sorted_ids.to(torch.int32), tile_start[:T], tile_expert[:T]


def plan(ids: torch.Tensor, E: int, block_n: int) -> tuple[torch.Tensor, ...]:
    """Tile tables for `ids` [M] (values in [0, E)): the one-program kernel for decode-sized M, torch ops above."""
    return (plan_triton if ids.shape[0] <= PLAN_MAX_ROWS else plan_torch)(ids, E, block_n)
