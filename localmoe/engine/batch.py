"""One decode step for many sequences at once, each with its own cache (continuous batching).

`decode_batch(model, tokens, caches)` runs one new token of each of N sequences through the
model as one batch: the embedding, every norm, every MLP / MoE layer and the lm_head see the N
tokens as one matrix [N, hidden], so a weight (and a routed expert, grouped by expert in
`moe.dispatch`) is read once per step for all of them. Only the token mixer (attention, MLA,
delta rule: the part that reads each sequence's own cache) runs per sequence, on its row, with
its own positions; the caches stay batch-1 `ModelCache`s of different lengths, so a sequence
joins or leaves between two steps without touching the others.

Plain GQA layers (`_gqa`) also project q/k/v and the output for all rows at once; only the cache
write and the attention itself run per sequence. Other mixers (MLA, DSA, delta rule, top-k
selecting attention) run each sequence alone on its row.

Dense models (GQA + SiLU MLP: Llama, SmolLM2, Qwen2, Qwen3), gpt-oss (GQA with sliding windows and sinks + routed
MXFP4 experts, resident or paged) and the hybrid form's models (Qwen3-MoE, GLM-4.5, Kimi K3, Kimi-Linear, Qwen3-Next,
DeepSeek-V3 / V3.2, Kimi K2.5, GLM-5, GLM-5-Next: KDA / Gated DeltaNet / MLA / GQA mixers, dense or MoE MLPs,
attention residuals, hyper-connections) whose fused single-sequence plan exists (engine/decode_plan.py) run the
whole step but the lm_head in one kernel call over all rows (`rows_plan`, kernels/decode_layers `DenseDecoder.rows`,
`GqaMoeDecoder.rows`, `HybridDecoder.rows`; a paged layer's experts called back once per layer for all rows): every
matrix and routed expert read once for all rows (a hybrid model's mixers row by row, its delta-rule rows of a verify
consecutive tokens of one state), and every row with the bits of the fused single-sequence step, so batched == alone
== `localmoe run` (and a speculative verify == `--spec off`) by construction. The layer loop below runs the models
without such a plan (no CPU kernel library, weights on a GPU, a layer the plans do not take) and the steps a plan
cannot take (a padded cache, a top-k attention selection dropping keys, a probe recording its selection).

Elsewhere a row's result does not depend on the others either: every matrix of N <= GEMV_MAX_ROWS rows (GGUF
block weights: ggml_gemv.MAX_ROWS, one kernel call decoding each block once for all rows) runs the decode
kernels, which compute each row independently, and larger batches are cut into such slices
(`_rowwise`). So a greedy sequence produces the same tokens alone or batched with 15
others. There the model's own decode step (its fused `DecodePlan`) rounds differently, so a worker uses one or
the other for every sequence and every step, never both (`fused=True`: each sequence its own fused step):
otherwise a request could part at a near-tie of its two best tokens depending on whether another sequence
happened to decode at the same step.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F

from localmoe.engine.cache import ModelCache
from localmoe.engine.layers.attention import GQAttention
from localmoe.engine.layers.moe import MoEBlock
from localmoe.engine.quantized import decode_rows
from localmoe.engine.rope import apply_rope
from localmoe.engine.step import make_step
from localmoe.kernels import ggml_gemv
from localmoe.kernels._cpu import small_steps
from localmoe.kernels.decode_layers import DenseDecoder, GqaMoeDecoder
from localmoe.kernels.decode_layers.hybrid import HybridDecoder
from localmoe.kernels.dense_gemv import GEMV_MAX_ROWS
from localmoe.kernels.gqa_decode import (cached_fields, gqa_decode, gqa_decode_paged, gqa_decode_rows, kernel_fields,
                                         rows_supported)
from localmoe.kernels.rms_norm import add_rms_norm


def has_rows(model) -> bool:
    """Whether `forward_rows` runs `model` (a Transformer: plain residuals or a per-token residual scheme),
    i.e. whether its decode steps batch: every family does (each row's bits equal its bits alone, tests/runtime
    test_batching.py and test_batched_families.py)."""
    return hasattr(model, "layers") and hasattr(model, "rope") and hasattr(model, "residuals")


def _residual_rows(model, x: torch.Tensor, steps, caches) -> tuple[torch.Tensor, torch.Tensor]:
    """forward_rows of a model whose residual scheme (K3's attention residuals, GLM-5-Next's hyper-connections)
    runs the layers itself: x [N, 1, D] embeddings -> (logits [N, 1, V], final-norm hidden [N, 1, D]); the mixers per row, the MLP / MoE
    over all rows (experts read once), the scheme's mixing per token."""
    D, eps, N = model.spec.hidden_size, model.eps, x.shape[0]

    def attn(i: int, h: torch.Tensor) -> torch.Tensor:
        norm, mixer = model.layers[i][0], model.layers[i][1]
        h = F.rms_norm(h, (D,), norm, eps)
        return torch.cat([mixer(h[n:n + 1], steps[n], caches[n].layers[i]) for n in range(N)])

    def mlp(i: int, h: torch.Tensor) -> torch.Tensor:
        _, _, norm, block = model.layers[i]
        h = F.rms_norm(h, (D,), norm, eps)
        return _moe_rows(block, h) if isinstance(block, MoEBlock) else _rowwise(block, h)

    h = F.rms_norm(model.residuals.run(x, attn, mlp), (D,), model.norm, eps)
    return _rowwise(model.lm_head, h), h


def _rowwise(fn, h: torch.Tensor) -> torch.Tensor:
    """fn over h [N, ...] in slices of at most fn's `independent_rows` (GEMV_MAX_ROWS where it does not
    say; GGUF block weights take ggml_gemv.MAX_ROWS): the decode kernels, which compute each row on its
    own (a row's result does not depend on the others)."""
    limit = getattr(fn, "independent_rows", GEMV_MAX_ROWS)
    if h.shape[0] <= limit:
        return fn(h)
    return torch.cat([fn(part) for part in h.split(limit)])


def _moe_rows(block: MoEBlock, h: torch.Tensor) -> torch.Tensor:
    """A MoE block over a step's rows h [N, 1, D]: one call (each routed expert read once for all rows) where it
    gives every row its alone-bits (`MoEBlock.independent_rows`), else in slices of that many rows; whole where it
    has no such limit (0: a latent MoE, group-limited routing; its rows then depend on each other)."""
    limit = block.independent_rows
    if not limit or h.shape[0] <= limit:
        return block(h)
    return torch.cat([block(part) for part in h.split(limit)])


def has_fused_step(model) -> bool:
    """Whether one sequence's decode step runs as one fused kernel call (engine/decode_plan.py)."""
    from localmoe.engine.decode_plan import DecodePlan

    return hasattr(model, "layers") and DecodePlan.build(model) is not None


MOE_MIN_ROWS = 16  # a MoE block must give this many rows of one call their alone-bits (a 16-row decode step)


def rows_independent(model) -> bool:
    """Whether every row of the batched step has the bits it has alone, so a prompt token run as a row has the
    same bits in any chunking and beside any other rows, and the runtime runs prompt chunks as rows of the
    batched step (engine/generate.py `decode_together(chunks=...)`). Dense models: every matrix takes a whole
    batch in one kernel call that reads and decodes each weight block once for all rows (GGUF blocks:
    ggml_gemv.MAX_ROWS rows, plain GQA and dense MLPs); then batching pays too (`batching_pays`). A model whose
    dense plan runs the rows (`rows_plan`) has them whatever its matrices. MoE models with plain GQA: every MoE
    block gives at least MOE_MIN_ROWS rows of one call their alone-bits (`MoEBlock.independent_rows`: routing and
    experts per token; `row_limit`), the other matrices in slices of their decode kernels (`_rowwise`): each routed
    expert is then read once per step for the decode rows and the prompt rows beside them."""
    if not has_rows(model) or model.residuals is not None:
        return False
    plan = rows_plan(model)
    if plan is not None and not isinstance(plan.decoder, HybridDecoder):  # (the hybrid plan runs mixers per row)
        return True
    matrices, moe = [model.lm_head], False
    for _, mixer, _, mlp in model.layers:
        if not _plain_gqa(mixer, ()):
            return False
        matrices += [mixer.qkv, mixer.o_proj] + ([mixer.gate] if mixer.gate is not None else [])
        if isinstance(mlp, MoEBlock):
            moe = True
            if mlp.independent_rows < MOE_MIN_ROWS:
                return False
        else:
            matrices.append(mlp)
    with decode_rows():
        return all(getattr(m, "independent_rows", 0) >= (1 if moe else ggml_gemv.MAX_ROWS) for m in matrices)


def row_limit(model) -> int | None:
    """The most rows one batched step of `model` runs in one call of every MoE block with each row's alone-bits
    (the least `MoEBlock.independent_rows`); None for a model without MoE blocks. `forward_rows` cuts a larger
    step's MoE calls into slices of this many rows (each slice reads its experts again); the worker keeps a step's
    prompt rows within it."""
    limits = [mlp.independent_rows for _, _, _, mlp in getattr(model, "layers", ()) if isinstance(mlp, MoEBlock)]
    return min(limits) if limits else None


def batching_pays(model) -> bool:
    """Whether the worker's "auto" mode batches this model's decode steps. Where the model's fused plan runs
    the rows (`rows_plan`: dense, gpt-oss and hybrid-form models), a batch of one costs the fused single-sequence
    step and each row has its bits: always. Otherwise a fused single-sequence
    step (kernels/decode_layers) is compute-bound per token on the CPU, so batching it through this module's
    op-by-op step lost while every row re-decoded the weights (measured in docs/performance.md). Batching
    wins where every matrix runs the multi-row kernels (`rows_independent`: the embedded SmolLM2 Q4_1 GGUF, a
    batch of 16 costs ~5x one sequence's step instead of ~16x), and for MoE models whose mixers are all plain
    GQA (gpt-oss, Qwen3-MoE): a step reads each routed expert once for every token routed to it and runs every
    sequence's attention in one kernel call (gpt-oss `small`, 16 clients: 1.42x one client's aggregate
    batched, 1.02x with the fused step per sequence). Models without a fused step batch. (Every fused plan has a rows
    form now, so the rest matters only where `rows_plan` declines: a probe recording a dense model's selection.)"""
    if rows_plan(model) is not None or not has_fused_step(model) or rows_independent(model):
        return True
    if model.residuals is not None:  # K3's attention residuals, GLM-5-Next's hyper-connections: mixers per row
        return False
    return all(_plain_gqa(mixer, ()) for _, mixer, _, _ in model.layers) and \
        any(isinstance(mlp, MoEBlock) for _, _, _, mlp in model.layers)


def _plain_gqa(mixer, caches) -> bool:
    """GQA without top-k selection or recording (those keep their own per-sequence path)."""
    return isinstance(mixer, GQAttention) and mixer.sparse_topk is None and not mixer.record_selection


def _gqa(mixer: GQAttention, h: torch.Tensor, steps, layer_caches, cos: torch.Tensor, sin: torch.Tensor,
         rows: torch.Tensor | None) -> torch.Tensor:
    """GQA decode of N sequences: the projections (and q/k norms, RoPE: cos/sin [N, 1, 1, rot], the rows'
    tables) for all rows at once, then every row's cache write and attention in one kernel call over the
    sequences' paged caches (`gqa_decode_rows` with this layer's `rows` [N, 10] from `_PagedRows`, else
    `gqa_decode_paged`); where a cache cannot be written in place (bf16/fp8 rows without their `_PagedRows`
    fields), the cache write and attention per sequence. h [N, 1, hidden] -> [N, 1, hidden]."""
    N = h.shape[0]
    H, Hkv, D = mixer.heads, mixer.kv_heads, mixer.head_dim
    qk, v = _rowwise(mixer.qkv, h).split((mixer.split[0] + mixer.split[1], mixer.split[2]), dim=-1)
    qk, v = qk.view(N, 1, H + Hkv, D), v.view(N, 1, Hkv, D)
    if mixer.q_norm is not None:
        qk = torch.cat([F.rms_norm(qk[:, :, :H], (D,), mixer.q_norm, mixer.eps),
                        F.rms_norm(qk[:, :, H:], (D,), mixer.k_norm, mixer.eps)], dim=2)
    rot = mixer.rotary_dim
    if rot < D:
        qk = torch.cat([apply_rope(qk[..., :rot], cos, sin), qk[..., rot:]], dim=-1)
    else:
        qk = apply_rope(qk, cos, sin)
    q, k = qk.split((H, Hkv), dim=2)
    if rows is not None and rows_supported(q[:, 0], k[:, 0], v[:, 0]):
        out = gqa_decode_rows(q[:, 0], k[:, 0], v[:, 0], rows, mixer.scale, mixer.head_sinks)
        return _gqa_out(mixer, h, out)
    window = mixer.window
    firsts = [max(0, step.start + 1 - window) if window else 0 for step in steps]
    # last row first: a cache on several rows (a verify) grows for its last position before the earlier
    # rows take its pools, so they all hold the grown ones
    pages = [getattr(cache, "pages", _no_pages)(step.start) for step, cache in zip(steps[::-1], layer_caches[::-1])][::-1]
    if None not in pages:
        out = gqa_decode_paged(q[:, 0], k[:, 0], v[:, 0], pages, [step.start for step in steps], firsts, mixer.scale,
                               mixer.head_sinks)
    else:
        out = []
        for n, (step, cache) in enumerate(zip(steps, layer_caches)):
            keys, values = cache.update(step.start, k[n:n + 1], v[n:n + 1])
            out.append(gqa_decode(q[n:n + 1, 0], keys, values, mixer.scale, firsts[n], None, mixer.head_sinks))
        out = torch.cat(out)
    return _gqa_out(mixer, h, out)


def _gqa_out(mixer: GQAttention, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The attention rows out [N, H, D] through the output gate (if any) and o_proj -> [N, 1, hidden]."""
    out = out.view(h.shape[0], 1, mixer.heads * mixer.head_dim)
    if mixer.gate is not None:
        out = out * torch.sigmoid(_rowwise(mixer.gate, h))
    return _rowwise(mixer.o_proj, out)


def _no_pages(pos: int) -> None:
    """`pages` of a layer cache that has no paged pools: None."""


class _PagedRows:
    """One sequence's paged K/V of every plain GQA layer as the attention kernel's fields (`kernel_fields`,
    [L, 8] int64: a layer that is not plain GQA has zeros), kept across steps while no buffer changed
    (`PagedBuffer.generation`: growth, trim) and positions stay below `capacity`: a step then prepares
    the fields of every layer and row with a few tensor operations (`_step_rows`) instead of a call per
    layer and sequence. `fields` is None where some layer's cache cannot be read by the kernel (bf16 / fp8
    rows without an identity block table, a cache without pages): the step then takes `_gqa`'s per-layer path.
    bf16 / fp8 caches are read and written in their own dtype (`cached_fields`: the views are held here)."""

    _kept: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()  # ModelCache -> its _PagedRows

    def __init__(self, model, cache: ModelCache, pos: int):
        fields, self.buffers, self.views = [], [], []
        for i, (_, mixer, _, _) in enumerate(model.layers):
            if not _plain_gqa(mixer, ()):
                fields.append((0,) * 8)
                continue
            layer = cache.layers[i]
            pages = getattr(layer, "pages", _no_pages)(pos)
            row = None if pages is None else kernel_fields(pages, mixer.kv_heads, mixer.head_dim)
            if row is None and pages is None and hasattr(layer, "keys"):  # bf16 / fp8: in their own dtype
                storage = layer.keys.storage(pos + 1), layer.values.storage(pos + 1)
                cached = None if None in storage else cached_fields(*storage, mixer.kv_heads, mixer.head_dim)
                if cached is not None:
                    row = cached[0]
                    self.views.append(cached[1])
            if row is None:
                fields = None
                break
            fields.append(row)
            self.buffers += [layer.keys, layer.values]
        self.fields = None if fields is None else torch.tensor(fields, dtype=torch.long)
        self.generations = [b.generation for b in self.buffers]
        self.capacity = min((b.capacity for b in self.buffers), default=cache.max_len)

    @classmethod
    def of(cls, model, cache: ModelCache, pos: int) -> _PagedRows:
        """cache's fields with room for position `pos` (made again where a buffer changed or must grow)."""
        kept = cls._kept.get(cache)
        if kept is None or pos >= kept.capacity or [b.generation for b in kept.buffers] != kept.generations:
            kept = cls._kept[cache] = cls(model, cache, pos)
        return kept


def _step_rows(model, starts: Sequence[int], caches: Sequence[ModelCache]) -> torch.Tensor | None:
    """Every layer's kernel rows for this step, [L, N, 10] int64 (row n: its cache's `_PagedRows` fields, its
    position starts[n], its first key under the layer's window), or None where some cache cannot be read by the
    kernel. A cache on several rows gets room for its last row's position before any row reads its pools."""
    last = {id(cache): start for start, cache in zip(starts, caches)}  # row order: the last row's wins
    kept = {key: _PagedRows.of(model, cache, last[key]) for key, cache in ((id(c), c) for c in caches)}
    if any(k.fields is None for k in kept.values()):
        return None
    fields = torch.stack([kept[id(cache)].fields for cache in caches], dim=1)  # [L, N, 8]
    L, N = fields.shape[:2]
    pos = torch.tensor(starts, dtype=torch.long)
    window = torch.tensor([getattr(mixer, "window", 0) or 0 for _, mixer, _, _ in model.layers], dtype=torch.long)
    first = torch.where(window[:, None] > 0, (pos + 1 - window[:, None]).clamp(min=0), 0)  # [L, N]
    return torch.cat([fields, pos.expand(L, N)[..., None], first[..., None]], dim=-1).contiguous()


@torch.inference_mode()
def decode_batch(model, tokens: Sequence[int], caches: Sequence[ModelCache], fused: bool = False) -> torch.Tensor:
    """One token for each of N sequences (token i appended to caches[i], each of batch 1) -> logits [N, V].
    `fused`: every sequence takes the model's own decode step, one after another (see the module docstring)."""
    if fused or not has_rows(model):  # the model's own decode step (its fused plan where it has one), each
        return torch.cat([model.forward(torch.tensor([[t]]), c)[:, -1] for t, c in zip(tokens, caches)])
    return forward_rows(model, tokens, caches)


@torch.inference_mode()
def forward_rows(model, tokens: Sequence[int], caches: Sequence[ModelCache],
                 wanted: Sequence[int] | None = None) -> torch.Tensor:
    """Row n appends tokens[n] to caches[n] -> logits [N, V] (of the rows in `wanted` only, in its order,
    where given), every row computed as a decode token (each row's result independent of the others). A
    cache may appear on several rows: its tokens take consecutive positions in row order (a speculative
    verify: the last token and the drafts of one sequence, engine/spec; a prompt chunk).
    The model must be `has_rows`: a model with attention residuals or hyper-connections mixes each token's
    layer outputs on its own, so its rows run through that scheme as a batch of rows."""
    N = len(tokens)
    ids = torch.tensor(tokens, dtype=torch.long, device=model.device).view(N, 1)  # the caches are on it too
    ahead: dict[int, int] = {}  # rows of each cache so far in this call
    starts = []
    for cache in caches:
        n = ahead.get(id(cache), 0)
        ahead[id(cache)] = n + 1
        starts.append(cache.reserve(n + 1) + n)
    eps = model.eps
    with small_steps(), decode_rows():
        x = F.embedding(ids, model.embed) if torch.is_tensor(model.embed) else model.embed(ids)
        h = _planned_rows(model, x, starts, caches)
        if h is not None:
            logits = _rowwise(model.lm_head, h if wanted is None else h[list(wanted)])
            for cache in caches:
                cache.advance(1)
            _tell_hidden(ids, h, starts, caches)
            return logits[:, -1]
        steps = [make_step(cache, start, 1, model.rope) for start, cache in zip(starts, caches)]
        if model.residuals is not None:
            logits, h = _residual_rows(model, x, steps, caches)
            for cache in caches:
                cache.advance(1)
            _tell_hidden(ids, h, starts, caches)
            return logits[:, -1] if wanted is None else logits[list(wanted), -1]
        h = add_rms_norm(x, None, model.layers[0][0], eps)
        cos = torch.cat([s.cos for s in steps]) if model.rope is not None else None  # [N, 1, 1, rot]
        sin = torch.cat([s.sin for s in steps]) if model.rope is not None else None
        rows = _step_rows(model, starts, caches)
        for i, (_, mixer, mlp_norm, mlp) in enumerate(model.layers):
            if _plain_gqa(mixer, caches):
                mixed = _gqa(mixer, h, steps, [cache.layers[i] for cache in caches], cos, sin,
                             None if rows is None else rows[i])
            else:  # other mixers: each row alone, in row order
                mixed = torch.cat([mixer(h[n:n + 1], steps[n], caches[n].layers[i]) for n in range(N)])
            h = add_rms_norm(x, mixed, mlp_norm, eps)
            following = model.layers[i + 1][0] if i + 1 < len(model.layers) else model.norm
            out = _moe_rows(mlp, h) if isinstance(mlp, MoEBlock) else _rowwise(mlp, h)  # MoE: experts read once
            h = add_rms_norm(x, out, following, eps)
        logits = _rowwise(model.lm_head, h if wanted is None else h[list(wanted)])
    for cache in caches:
        cache.advance(1)
    _tell_hidden(ids, h, starts, caches)
    return logits[:, -1]


def rows_plan(model):
    """The model's fused decode plan (engine/decode_plan.py), which runs the batched step's rows: its dense or gpt-oss
    form (`DenseDecoder.rows`, `GqaMoeDecoder.rows`) where every layer is plain GQA now (a probe records its
    selection), its hybrid form (`HybridDecoder.rows`: Qwen3-MoE, GLM-4.5, Kimi K3, Kimi-Linear, Qwen3-Next,
    DeepSeek, ...; a step it cannot take now, `hybrid_rows` says so and the layers run op by op): every layer for
    every row in one kernel call, each row with the bits of the fused single-sequence step, a paged MoE layer's
    experts called back once per layer for all rows. None for a model without one."""
    plan = model.decode_plan() if hasattr(model, "decode_plan") else None
    if plan is not None and isinstance(plan.decoder, HybridDecoder):
        return plan
    if plan is None or not isinstance(plan.decoder, (DenseDecoder, GqaMoeDecoder)):
        return None
    return plan if all(_plain_gqa(mixer, ()) for _, mixer, _, _ in model.layers) else None


def _planned_rows(model, x: torch.Tensor, starts: Sequence[int], caches: Sequence[ModelCache]) -> torch.Tensor | None:
    """forward_rows' layers through the model's dense plan (`rows_plan`): x [N, 1, D] embeddings at positions
    `starts` -> the final-normed hidden states [N, 1, D]; None (nothing done) where the plan does not take this
    step (no plan, a padded cache, a cache the paged kernel cannot read)."""
    plan = rows_plan(model)
    if plan is None or any(cache.key_mask is not None for cache in caches):
        return None
    N = x.shape[0]
    if isinstance(plan.decoder, HybridDecoder):
        from localmoe.engine.decode_plan import hybrid_rows

        h = hybrid_rows(plan, x.reshape(N, -1).float().contiguous(), list(starts), list(caches))
        return None if h is None else h.view(N, 1, -1)
    rows = _step_rows(model, starts, caches)
    if rows is None:
        return None
    at = torch.tensor([start + cache.rope_delta for start, cache in zip(starts, caches)], dtype=torch.long)
    h = plan.decoder.rows(x.reshape(N, -1).float().contiguous(), rows, model.rope.cos[at], model.rope.sin[at])
    return h.view(N, 1, -1)


def _tell_hidden(ids: torch.Tensor, h: torch.Tensor, starts: Sequence[int], caches: Sequence[ModelCache]) -> None:
    """Hand each cache's `hidden_sink` (if any) its rows' final-norm hidden states h [N, 1, D], in row order."""
    rows: dict[int, list[int]] = {}
    for n, cache in enumerate(caches):
        if cache.hidden_sink is not None:
            rows.setdefault(id(cache), []).append(n)
    for ns in rows.values():
        cache = caches[ns[0]]
        cache.hidden_sink(starts[ns[0]], ids[ns, 0], h[ns, 0], False)
