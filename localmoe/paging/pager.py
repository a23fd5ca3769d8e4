"""The pager: an ExpertProvider that keeps experts in a fixed RAM slab and reads misses from disk.

`get(layer, expert)` returns the expert's weights as zero-copy views of its slot (valid
until the next `get`, as the ExpertProvider protocol says); `hold(layer, experts)` returns a
layer's chosen experts valid together (until the next `get` or `hold`), so the MoE kernel runs
them in one call. A miss evicts the victim the policy picks and reads the extent on a reader
thread (readers.py: C++ ones for the plain O_DIRECT backend; timeout: `ReadTimeoutError`). The
readers only read and check bytes and never take the pager's lock: the pager takes in the finished
reads whenever it is entered, and waits on a read only when its expert is needed. The tensors over
a slot are built on the compute thread, once per (expert layout, slot), and reused, since a
slot's memory never moves.
Routers wrapped by `paging.hooks.attach` tell the pager each layer's chosen experts before
dispatch (`begin_layer`: their loads start together, in parallel) and the next layer's
likely ones (`prefetch`: router lookahead); loads run while compute continues. A guess goes to the readers only
once no demanded read is left (`_flush`): the disk's rate is shared by the reads in flight.

Never evicted: the experts last returned (the caller is computing them), pinned experts (a
calibration profile), and loads in flight. Prefetches never evict the current layer's
chosen experts or an unused prefetch, and hold at most a quarter of the slots unused; a guess its layer's
next routing does not choose becomes an ordinary cached expert (evictable; counted wasted).

With GPU tiers (`use_gpus`), `placed(layer, expert, tokens)` hands out an expert a GPU holds
from there; otherwise it gets it through the RAM tier and lets the cost model (placement.place)
decide whether to copy it to its GPU and compute it there, or to compute it on the CPU. The
hottest experts of a calibration profile are copied to the GPUs first and pinned there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from localmoe.engine.experts import ExpertWeights
from localmoe.engine.linear import engine_dtype, stored_dtype
from localmoe.paging.disk import DiskBackend
from localmoe.paging.errors import PagingError, ReadTimeoutError
from localmoe.paging.placement import Bandwidths, place
from localmoe.paging.policy import Key, Policy
from localmoe.paging.readers import make_readers
from localmoe.paging.slab import HostSlab
from localmoe.paging.stats import PagingStats

EMPTY, LOADING, READY, DEAD = "empty", "loading", "ready", "dead"


def _wide(layout) -> tuple[str, ...]:
    """The parts of an expert layout a resident model would store as bf16 matrices when they are fp32."""
    return tuple(p.name for p in layout.parts if p.dtype == torch.float32 and len(p.shape) >= 2 and p.nbytes)


def _rank(position: int, distance: int = 1):
    """A guess's rank for its measured precision: its position in one token's guess, with its distance (in MoE
    layers) from the routed layer that made it where that is beyond the next one."""
    return position if distance == 1 else (distance, position)


def _half(t: torch.Tensor) -> torch.Tensor:
    """bf16 of `t`'s shape over the first half of fp32 `t`'s bytes."""
    return t.reshape(-1).view(torch.bfloat16)[:t.numel()].view(t.shape)
# One token's guesses are read from the best rank down while a rank's measured precision (settled guesses of that
# rank its layer's routing chose, decayed, from a prior of 1 in 2) reaches GUESS_BAR: in a disk-bound pass a wrong
# guess's read costs about what a right one saves. Every EXPLORE-th routed layer guesses every rank (to keep
# measuring them).
GUESS_BAR, EXPLORE, GUESS_DECAY = 0.5, 16, 0.97
# Guesses are handed to the readers only once the demanded reads are in (`Pager._flush`): the disk's rate is shared.
HOLD_BACK = True
DEMAND, EARLY, LOOKAHEAD = "demand", "early", "lookahead"  # why a load started


class _Slot:
    __slots__ = ("gen", "index", "key", "origin", "rank", "read", "state", "used")

    def __init__(self, index: int):
        self.index, self.key, self.state, self.read = index, None, EMPTY, None
        self.origin, self.used, self.gen, self.rank = DEMAND, True, 0, None


class _Read:
    """One load of `key` into `slot` (its generation `gen`), submitted to the readers as `id` (`urgent`: demanded;
    `submitted` False: a guess held back while demanded reads run, `Pager._flush`): `done` once reaped (with
    `error` where it failed). There is no Future per read: the compute thread waits on the readers."""

    __slots__ = ("done", "error", "gen", "id", "key", "slot", "submitted", "urgent")

    def __init__(self, read_id: int, slot: _Slot, key: Key, urgent: bool):
        self.id, self.slot, self.key, self.gen, self.urgent = read_id, slot, key, slot.gen, urgent
        self.done, self.submitted = False, False
        self.error: BaseException | None = None


class Pager:
    """Experts of `store` (a PackedStore) paged through `num_slots` RAM slots."""

    waits = True  # `get` may wait for reads (engine/experts.py ExpertProvider)

    def __init__(self, store, num_slots: int, policy: Policy, backend: DiskBackend, *, io_threads: int = 4,
                 timeout: float = 30.0, pinned: Sequence[Key] = (), prefetch: bool = True,
                 native: bool | None = None, dtype: str | None = None):
        self.store, self.policy, self.backend, self.timeout = store, policy, backend, timeout
        self.layouts = {layer: store.layout(layer) for layer in store.layers()}
        # the engine dtype (EngineConfig.dtype; None: the store's): dense expert matrices as a resident model stores
        # them (linear.stored_dtype): fp32 ones rounded to bf16 in their slot as they are read where the engine's
        # dtype is bf16; at `load_all` also where it is fp32 and every value of the layer is exactly bf16
        self.dtype = dtype
        narrow = dtype is not None and engine_dtype(dtype) == torch.bfloat16
        self._narrow = {layer: _wide(layout) if narrow else () for layer, layout in self.layouts.items()}
        self._kinds()
        self._views: dict[tuple[int, int], ExpertWeights] = {}  # (layout kind, slot) -> the tensors over it
        self._experts = {layer: len(store.experts_in(layer)) for layer in self.layouts}
        self._count = dict.fromkeys(self.layouts, 0)  # experts of each layer in a slot (loading or ready)
        self._guesses: dict[int, set[Key]] = {layer: set() for layer in self.layouts}  # unsettled lookahead loads
        self._ranks: dict[object, tuple[float, float]] = {}  # a guess's rank (`_rank`) -> (chosen, settled), decayed
        self._routed = 0  # guess_width calls
        self._evictable: dict[Key, _Slot] = {}  # ready, requested since loaded, not pinned: what hints may evict
        self._resident = None  # ResidentExperts over the slots once `load_all` pinned every expert
        slot_bytes = max(layout.slot_bytes for layout in self.layouts.values())
        self.slab = HostSlab(num_slots, slot_bytes)
        self.slots = [_Slot(i) for i in range(num_slots)]
        self.free = list(reversed(range(num_slots)))
        self.where: dict[Key, _Slot] = {}
        self.lock = threading.Lock()  # the pager's state (the readers never take it)
        self.io_threads = max(1, io_threads)
        # native: the C++ readers (None: where the backend and the CPU library allow them), else Python threads
        self.readers = make_readers(backend, self.slab, self.io_threads, native)
        self._reads: dict[int, _Read] = {}  # started, not yet reaped
        self._demanded = 0  # demanded reads submitted, not yet reaped
        self._held_back: list[_Read] = []  # guesses not submitted while demanded reads run (`_flush`), in order
        self._spare: list[Key] = []  # the policy's next victims, kept within one `begin_layer` (`_make_room`)
        self._guessed_last = 0  # guesses the last `begin_layer` made room for
        self._next_id, self._busy_seen = 0, 0.0
        self.prefetch_enabled = prefetch
        self.guess_bar = GUESS_BAR  # the measured precision a guessed rank needs to be read (`guess_width`)
        self.hold_back = HOLD_BACK  # guesses wait for the demanded reads (`_flush`)
        self.held: tuple[_Slot, ...] = ()  # the slots last handed out (being computed)
        self.protected: set[Key] = set()  # the current layer's chosen experts not yet requested
        self.step, self._last_layer = 0, None
        self.lost_slots = 0  # slots given up to reads that timed out
        self.gpu = None  # GpuTier (use_gpus), when --gpu-mem is given
        self.bandwidths: Bandwidths | None = None  # the placement cost model's, with the GPU tier
        self.hot = list(pinned)  # a calibration profile's experts, hottest first
        self.stats = PagingStats(policy=policy.name, backend=backend.name, slots=num_slots, slot_bytes=slot_bytes)
        self.pinned: set[Key] = set()
        for key in list(pinned)[:num_slots // 2]:  # keep half the slab for everything else
            self.get(*key)
            self.pinned.add(key)
            self._unpool(key)
        self.held = ()
        self.stats = PagingStats(policy=policy.name, backend=backend.name, slots=num_slots, slot_bytes=slot_bytes)

    # ---- the ExpertProvider protocol ----

    def get(self, layer: int, expert: int) -> ExpertWeights:
        started = time.perf_counter()
        with self.lock:
            self._reap()
            self._see_layer(layer, new_step_at_same=False)
            self.held = ()
            slot = self._request((layer, expert))
            self.held = (slot,)
            read = slot.read if slot.state != READY else None
        waited = self._wait([read]) if read is not None else 0.0
        weights = self._weights(layer, slot)
        self.stats.ram.lookup_seconds += time.perf_counter() - started - waited
        return weights

    def hold(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights] | None:
        """`experts` of `layer` (distinct ids), all valid together until the next `get` or `hold`, in the given
        order; None where the slab cannot hold them at once beside the pinned ones (or GPU tiers place experts
        one by one: `placed`): then `get` them one at a time. Counts as one request per expert, as `get`."""
        if self.gpu is not None or len(experts) > len(self.slots) - len(self.pinned) - self.lost_slots:
            return None
        started = time.perf_counter()
        with self.lock:
            self._reap()
            self._see_layer(layer, new_step_at_same=False)
            self.held = ()
            slots = []
            for e in experts:
                slots.append(self._request((layer, e)))
                self.held = tuple(slots)
            pending = [s.read for s in slots if s.state != READY]
        waited = self._wait(pending) if pending else 0.0
        weights = [self._weights(layer, s) for s in slots]
        self.stats.ram.lookup_seconds += time.perf_counter() - started - waited
        return weights

    def _request(self, key: Key) -> _Slot:
        """The slot of a demanded `key`, its load started if missing; counts the request (lock held)."""
        ram, pf = self.stats.ram, self.stats.prefetch
        self.protected.discard(key)
        slot = self.where.get(key)
        if slot is None:
            ram.misses += 1
            pf.uncovered += 1
            slot = self._allocate(demand=True)
            self._start(slot, key, DEMAND)
        elif not slot.used:  # first request of a load started before it
            if slot.state == LOADING and not slot.read.submitted:  # a guess held back: needed now
                self._held_back.remove(slot.read)
                self._submit(slot.read, urgent=True)
            if slot.origin == LOOKAHEAD:
                ram.hits += 1
                pf.covered += 1
                pf.late += slot.state == LOADING
            self._settle(slot, chosen=True)  # EARLY: begin_layer counted the miss already
        else:
            ram.hits += 1
        self.policy.access(key, self.step)
        return slot

    def _kinds(self) -> None:
        """Layers with the same layout and the same matrices rounded to bf16 share slot views."""
        forms = {layer: (layout, self._narrow[layer]) for layer, layout in self.layouts.items()}
        kinds = list(dict.fromkeys(forms.values()))
        self._kind = {layer: kinds.index(form) for layer, form in forms.items()}

    def _parts(self, layer: int, index: int) -> dict:
        """The tensors over slot `index` in `layer`'s layout, its rounded matrices as bf16 over their first half."""
        views = self.layouts[layer].views(self.slab.slot(index))
        for name in self._narrow[layer]:
            views[name] = _half(views[name])
        return views

    def _weights(self, layer: int, slot: _Slot) -> ExpertWeights:
        """The tensors over `slot` in `layer`'s layout: built once per (layout, slot) and kept (the slab never moves)."""
        kind = (self._kind[layer], slot.index)
        weights = self._views.get(kind)
        if weights is None:
            weights = self._views[kind] = ExpertWeights.from_parts(self._parts(layer, slot.index))
        return weights

    def _round(self, layer: int, index: int, names: Sequence[str]) -> None:
        """Slot `index`'s fp32 matrices `names` (just read, or pinned) rounded to bf16 in place, over their first
        half: as `Tensor.to` rounds a resident model's (the same bits), within the slot's bytes (lock held)."""
        views = self.layouts[layer].views(self.slab.slot(index))
        for name in names:
            _half(views[name]).copy_(views[name].to(torch.bfloat16))

    def load_all(self) -> bool:
        """Where the slab holds every expert of the model (and no GPU tier or Belady trace is in play): read them
        all now and pin them, so each layer is handed to the kernels whole (`kernel_table`, `dense_table`,
        `block_table`, as a resident provider does: routing joins the experts' kernel call). Returns whether it
        did; the reads count as loads."""
        layers = {layer: self.store.experts_in(layer) for layer in self.layouts}
        if (self.gpu is not None or self.policy.name == "belady" or self._resident is not None
                or sum(map(len, layers.values())) > len(self.slots) - self.lost_slots
                or any(experts != list(range(len(experts))) for experts in layers.values())):
            return self._resident is not None
        from localmoe.engine.experts import ResidentExperts

        held = {layer: self.hold(layer, experts) for layer, experts in layers.items()}
        with self.lock:
            self.pinned |= set(self.where)
            for key in list(self._evictable):
                self._unpool(key)
            self.held = ()
            if self.dtype is not None:  # fp32 matrices exactly bf16 kept as bf16, as a resident model keeps them
                for layer in layers:
                    names = _wide(self.layouts[layer])
                    if self._narrow[layer] or not names:
                        continue
                    slots = [self.where[(layer, e)].index for e in layers[layer]]
                    mats = [v for i in slots for n, v in self.layouts[layer].views(self.slab.slot(i)).items()
                            if n in names]
                    if stored_dtype(mats, self.dtype) == torch.bfloat16:
                        for i in slots:
                            self._round(layer, i, names)
                        self._narrow[layer] = names
                self._kinds()
                self._views.clear()
                held = {layer: [self._weights(layer, self.where[(layer, e)]) for e in experts]
                        for layer, experts in layers.items()}
        self._resident = ResidentExperts(held)
        return True

    def form(self, layer: int) -> ExpertWeights:
        """An expert of `layer`'s form (engine/experts.py ExpertProvider): the views over the first slot."""
        return ExpertWeights.from_parts(self._parts(layer, 0))

    def kernel_table(self, layer: int):
        """The layer's MXFP4 table for the MoE kernel once `load_all` pinned every expert; else None."""
        return None if self._resident is None else self._resident.kernel_table(layer)

    def dense_table(self, layer: int):
        return None if self._resident is None else self._resident.dense_table(layer)

    def block_table(self, layer: int):
        return None if self._resident is None else self._resident.block_table(layer)

    def experts_in(self, layer: int) -> int:
        """How many experts `layer` has."""
        return self._experts.get(layer, 0)

    def holds_all(self, layer: int) -> bool:
        """Whether every expert of `layer` is in a slot (loaded or loading): a guess at its experts loads nothing."""
        return self._count.get(layer, 0) >= self._experts.get(layer, 1)

    def nbytes(self) -> int:
        """Host RAM held for experts (GPU slots are device memory: `gpu.nbytes()`)."""
        return self.slab.nbytes

    # ---- hints from the wrapped routers (paging/hooks.py) ----

    def begin_layer(self, layer: int, experts: Iterable[int],
                    ahead: Sequence[tuple[int, Sequence[int]]] | Callable[[], Sequence] = (),
                    ranked: bool = False) -> None:
        """`experts` of `layer` (distinct ids) are about to be requested (routing is known): load the missing ones
        now (read before any guess). The layer's earlier guesses that routing did not choose are settled (wasted;
        not read at all where no reader took them yet). `ahead` = [(later layer, guessed experts)], nearest first:
        then `prefetch` those (the layer's reads start before the guesses are made). `ranked`: each of `ahead`'s
        lists is one token's guess, best first (an expert's position is its rank: `guess_width` measures each
        rank's precision). Not `ranked` (several rows' union of guesses, most voted first), where the layer's own
        misses outnumber the readers (each has a read, more wait) and its routing chose under GUESS_BAR of its
        experts, only the nearest layer's first guesses, one per reader, are kept: they read in the disk's idle time
        once the layer's reads are in (`_flush`), where the whole union wasted a quarter of the bytes (16 batched
        rows of gpt-oss `large` at 25%: 8.9 wasted guesses per generated token). Where the rows chose most of the
        layer's experts (a step carrying prompt rows), the next layer's rows will too: its union of guesses is then
        mostly right, and its reads run while this layer's experts compute (hundreds of prompt rows' work) instead
        of after it.
        `ahead` may be a function giving that list, called once this layer's reads are submitted. Guesses go to the
        readers only once no demanded read is left (`_flush`)."""
        started = time.perf_counter()
        with self.lock:
            self._reap()
            self._see_layer(layer, new_step_at_same=True)
            keys = [(layer, e) for e in sorted(experts)]
            for key in self._guesses.get(layer, set()) - set(keys):  # guesses the routing did not choose
                slot = self.where[key]
                self._settle(slot, chosen=False)
                if slot.state == LOADING and not slot.read.submitted:  # held back: never read
                    self._held_back.remove(slot.read)
                    del self._reads[slot.read.id]
                    self._free_slot(slot)
                elif slot.state == LOADING and self.readers.cancel(slot.read.id):  # not read yet: not read at all
                    del self._reads[slot.read.id]
                    self._free_slot(slot)
            for key in keys:  # guesses held back that routing chose: demanded now
                slot = self.where.get(key)
                if slot is not None and slot.state == LOADING and not slot.read.submitted:
                    self._held_back.remove(slot.read)
                    self._submit(slot.read, urgent=True)
            if self.prefetch_enabled:
                self.protected = set(keys)
                missing = [key for key in keys if key not in self.where and not self._on_gpu(key)]
                self._spare = []  # the policy's next victims, ranked with the misses' for the guesses (`_make_room`),
                # as many as the last layer's guesses took (a cost only: the guesses ask again where they run short)
                for key, slot in zip(missing, self._make_room(len(missing), more=self._guessed_last)):  # reads first
                    self.stats.ram.misses += 1
                    self.stats.prefetch.uncovered += 1
                    self._start(slot, key, EARLY)
                wide = len(keys) >= GUESS_BAR * self._experts.get(layer, len(keys))  # most of the layer chosen
                few = not ranked and len(missing) > self.io_threads and not wide  # several rows' union: docstring
                guessed = []  # (computed while those reads run), the nearest layer's first
                if callable(ahead):  # the later layers' routers: the hints' work, counted apart too
                    clock = time.perf_counter()
                    ahead = ahead()
                    self.stats.prefetch.hint_seconds += time.perf_counter() - clock
                for distance, (later, guess) in enumerate(ahead[:1] if few else ahead, 1):
                    guessed += self._guessed(later, guess, len(guessed), ranked, distance)
                if few:  # the most voted, one per reader: read once the layer's own reads are in
                    guessed = guessed[:self.io_threads]
                for (key, rank), slot in zip(guessed, self._make_room(len(guessed), spare=True)):
                    self.stats.prefetch.issued += 1
                    self._start(slot, key, LOOKAHEAD, rank)
                self._spare, self._guessed_last = [], len(guessed)
        self.stats.ram.lookup_seconds += time.perf_counter() - started

    def hinted(self, seconds: float) -> None:
        """A wrapped router spent `seconds` of the compute thread on its hints before `begin_layer` (the guesses'
        widths, the chosen set): the pager's work, counted as lookup and apart as `prefetch.hint_seconds` (with the
        later layers' routers `begin_layer` calls)."""
        self.stats.ram.lookup_seconds += seconds
        self.stats.prefetch.hint_seconds += seconds

    def guess_width(self, k: int, distance: int = 1) -> int:
        """How many of one token's k guessed experts of the MoE layer `distance` layers after the routed one (best
        first) are worth reading: the leading ranks whose measured precision at that distance reaches GUESS_BAR
        (all k every EXPLORE-th routed layer); 0: guess nothing. Called for distance 1 first, once per routed
        layer."""
        with self.lock:
            self._routed += distance == 1
            if self._routed % EXPLORE == 0:
                return k
            width = 0
            while width < k and self._precision(_rank(width, distance)) >= self.guess_bar:
                width += 1
            return width

    def _precision(self, rank) -> float:
        """The measured precision of a guess's rank (`_rank`: its position, and its distance beyond 1)."""
        chosen, settled = self._ranks.get(rank, (0.0, 0.0))
        return (chosen + 1.0) / (settled + 2.0)

    def prefetch(self, layer: int, experts: Iterable[int]) -> int:
        """Guess: `experts` of `layer` will be requested soon. Loads what fits; returns loads started."""
        if not self.prefetch_enabled:
            return 0
        clock = time.perf_counter()
        with self.lock:
            self._reap()
            guessed = self._guessed(layer, experts)
            slots = self._make_room(len(guessed))
            for (key, _), slot in zip(guessed, slots):
                self.stats.prefetch.issued += 1
                self._start(slot, key, LOOKAHEAD)
        self.stats.ram.lookup_seconds += time.perf_counter() - clock
        return len(slots)

    def _guessed(self, layer: int, experts: Iterable[int], more: int = 0, ranked: bool = False, distance: int = 1
                 ) -> list[tuple[Key, object]]:
        """(key, rank: `_rank` of its position and `distance` where `ranked`, else None) of the guessed experts a
        prefetch would load, in order: not in a slot or on a GPU, while unused lookahead loads (and `more` about to
        start) stay under a quarter of the slots (lock held)."""
        if layer not in self.layouts:
            return []
        first = {}
        for rank, e in enumerate(experts):
            key = (layer, int(e))
            if key not in first and key not in self.where and not self._on_gpu(key):
                first[key] = _rank(rank, distance) if ranked else None
        return list(first.items())[:max(0, max(1, len(self.slots) // 4) - self.stats.prefetch.pending - more)]

    # ---- GPU tiers ----

    def use_gpus(self, slabs, bandwidths: Bandwidths) -> None:
        """Add GPU tiers over `slabs` (GpuSlab per device), placing by `bandwidths`; the calibration
        profile's hottest experts are copied to their GPUs and pinned (at most half of each). Before
        `load_all` only (hooks.attach with `whole=False`, as `localmoe.paging` attaches with GPU slabs): a
        pager that already hands its layers out whole has no router hooks to place experts by."""
        from localmoe.paging.gpu import GpuTier

        if self._resident is not None:
            raise RuntimeError("GPU tiers added to a pager that already holds every expert whole (load_all): "
                               "attach the routers with whole=False before use_gpus")

        self.gpu = GpuTier(slabs, list(self.layouts), self.policy.name, self.stats)
        self.bandwidths = bandwidths
        for key in self.hot:
            if key[0] in self.layouts and key not in self.gpu and self.gpu.room_to_pin(key[0]):
                self.get(*key)
                if self.gpu.load(key, self._host_bytes(key), self.layouts[key[0]], self.step) is not None:
                    self.gpu.pin(key)
                    self.pinned.discard(key)  # computed from its GPU: its RAM slot may go to others
                    self._mark_evictable(self.where.get(key))
        self.held = ()
        self.stats.reset_counts()  # the preload is set-up, not traffic

    def placed(self, layer: int, expert: int, tokens: int) -> tuple[ExpertWeights, str]:
        """(weights, tier) to compute expert `expert` of `layer` on `tokens` tokens: from its GPU if it
        is there; else from RAM (`get`), copied to its GPU first where copying and computing there
        beats computing it on the CPU (placement.place). Without GPU tiers: (`get`, "ram")."""
        if self.gpu is None:
            return self.get(layer, expert), "ram"
        key, name = (layer, expert), self.gpu.name_of(layer)
        with self.lock:
            self._see_layer(layer, new_step_at_same=False)
        weights = self.gpu.lookup(key, self.step)
        if weights is None:
            weights = self.get(layer, expert)
            if place(self.layouts[layer].slot_bytes, tokens, self.bandwidths).where == "cpu":
                name = "ram"
            else:
                moved = self.gpu.load(key, self._host_bytes(key), self.layouts[layer], self.step)
                weights, name = (weights, "ram") if moved is None else (moved, name)
        self.stats.computed[name] = self.stats.computed.get(name, 0) + 1
        return weights, name

    def _on_gpu(self, key: Key) -> bool:
        return self.gpu is not None and key in self.gpu

    def _host_bytes(self, key: Key):
        """The RAM slot bytes of a resident `key` (a uint8 tensor; pinned on a CUDA machine)."""
        with self.lock:
            return self.slab.slot_tensor(self.where[key].index)

    # ---- slots ----

    def _see_layer(self, layer: int, new_step_at_same: bool) -> None:
        """A request for `layer`: a layer before the last one seen (or the same one, for a routing
        hint) starts the next forward pass (lock held)."""
        last = self._last_layer
        if last is not None and (layer < last or (new_step_at_same and layer == last)):
            self._new_step()
        self._last_layer = layer
        self.stats.steps = self.step + 1

    def _new_step(self) -> None:
        self.step += 1
        self.stats.steps = self.step + 1

    def _allocate(self, demand: bool) -> _Slot | None:
        """A free slot, or the policy's victim among the evictable ones (lock held)."""
        deadline = time.monotonic() + self.timeout
        while True:
            if self.free:
                return self.slots[self.free.pop()]
            ready = [s for s in self.slots if s.state == READY and s not in self.held and s.key not in self.pinned]
            soft = [s for s in ready if s.key not in self.protected and s.used]
            pool = soft or (ready if demand else [])
            if pool:
                by_key = {s.key: s for s in pool}
                victim = by_key[self.policy.victim(list(by_key), self.step)]
                self._evict(victim)
                return victim
            if not demand:
                return None
            for read in self._held_back:  # a slot must come free: what is held back reads now
                self._submit(read, urgent=False)
            self._held_back = []
            left = deadline - time.monotonic()
            if left <= 0 or not any(s.state == LOADING for s in self.slots):
                raise PagingError(f"no expert slot can be freed ({len(self.slots)} slots, {len(self.pinned)} "
                                  f"pinned, {self.lost_slots} lost to timed-out reads); raise --ram")
            self.lock.release()  # wait for a read to end without the pager's lock
            try:
                self.readers.wait_any(left)
            finally:
                self.lock.acquire()
            self._reap()

    def _make_room(self, n: int, more: int = 0, spare: bool = False) -> list[_Slot]:
        """Up to `n` slots for loads nobody waits for yet (routing hints): free ones, then the policy's victims
        among the evictable slots that are neither the current layer's chosen experts nor unused loads, picked in
        one policy call (the same victims, in the same order, as one `_allocate` after another; lock held). Every
        policy orders candidates by their own scores, so its first picks over all evictable slots, less the held
        and protected ones, are its picks over the others. `more`: also rank that many next victims and keep them
        (`_spare`); `spare`: take the victims from those where they suffice (no access, no slot joining the pool
        and the same held and protected keys since: `begin_layer`'s guesses after its own reads), else ask again."""
        out = [self.slots[self.free.pop()] for _ in range(min(n, len(self.free)))]
        if len(out) < n and self._evictable:
            need = n - len(out)
            if spare and len(self._spare) >= need:
                picks, self._spare = self._spare[:need], self._spare[need:]
            else:
                keep = {s.key for s in self.held} | self.protected
                ranked = self.policy.pool_victims(self.step, need + more + len(keep))  # the policy's copy of the pool
                ranked = [k for k in ranked if k not in keep]
                picks, self._spare = ranked[:need], ranked[need:need + more]
            for key in picks:
                out.append(self._evictable[key])
                self._evict(out[-1])
        return out

    def _settle(self, slot: _Slot, chosen: bool) -> None:
        """`slot`'s load, not yet requested, is requested now or (a lookahead guess) its layer's routing did not
        choose it (`chosen` False): it becomes an ordinary cached expert, evictable by the hints; a guess counts as
        used or wasted (lock held)."""
        if slot.origin == LOOKAHEAD and not slot.used:
            pf = self.stats.prefetch
            pf.pending -= 1
            pf.used += chosen
            pf.wasted += not chosen
            self._guesses[slot.key[0]].discard(slot.key)
            if slot.rank is not None:
                hit, settled = self._ranks.get(slot.rank, (0.0, 0.0))
                self._ranks[slot.rank] = (hit * GUESS_DECAY + chosen, settled * GUESS_DECAY + 1.0)
        slot.used = True
        self._mark_evictable(slot)

    def _mark_evictable(self, slot: _Slot | None) -> None:
        """`slot` joins the hints' eviction pool if it is ready, requested and not pinned (lock held)."""
        if slot is not None and slot.state == READY and slot.used and slot.key not in self.pinned:
            self._evictable[slot.key] = slot
            self.policy.join_pool(slot.key)

    def _unpool(self, key: Key) -> None:
        """`key` leaves the hints' eviction pool (lock held)."""
        if self._evictable.pop(key, None) is not None:
            self.policy.leave_pool(key)

    def _evict(self, slot: _Slot) -> None:
        self._forget(slot)
        self.stats.ram.evictions += 1
        slot.key, slot.state, slot.read = None, EMPTY, None

    def _free_slot(self, slot: _Slot) -> None:
        """`slot`'s load is dropped (failed, or a guess cancelled before its read): the slot is free (lock held)."""
        self._forget(slot)
        slot.gen += 1
        slot.key, slot.state, slot.read = None, EMPTY, None
        self.free.append(slot.index)

    def _forget(self, slot: _Slot) -> None:
        """`slot`'s expert leaves the tier (lock held); an unsettled guess is wasted."""
        if slot.origin == LOOKAHEAD and not slot.used:
            self._settle(slot, chosen=False)
        del self.where[slot.key]
        self._unpool(slot.key)
        self.policy.evict(slot.key)
        self._count[slot.key[0]] -= 1

    def _start(self, slot: _Slot, key: Key, origin: str, rank=None) -> None:
        slot.gen += 1
        slot.key, slot.state, slot.origin, slot.used, slot.rank = key, LOADING, origin, origin == DEMAND, rank
        self.where[key] = slot
        self._count[key[0]] += 1
        if origin == LOOKAHEAD:
            self.stats.prefetch.pending += 1
            self._guesses[key[0]].add(key)
        self.policy.insert(key, self.step)
        self._next_id += 1
        slot.read = self._reads[self._next_id] = _Read(self._next_id, slot, key, urgent=origin != LOOKAHEAD)
        if slot.read.urgent or not self._demanded or not self.hold_back:
            self._submit(slot.read, slot.read.urgent)
        else:
            self._held_back.append(slot.read)

    def _submit(self, read: _Read, urgent: bool) -> None:
        """Hands `read` to the readers (lock held)."""
        read.submitted, read.urgent = True, urgent
        self._demanded += urgent
        self.readers.submit(read.id, read.key, read.slot.index, urgent=urgent)

    def _flush(self) -> None:
        """Submits the guesses held back once no demanded read is left (lock held): the disk's rate is shared by the
        reads in flight, so a guess read beside a layer's demanded reads delays the kernel call that waits for them;
        held back, it reads while that layer computes."""
        if self._held_back and not self._demanded:
            held, self._held_back = self._held_back, []
            for read in held:
                self._submit(read, urgent=False)

    def _reap(self) -> None:
        """Take in the reads the readers finished: a slot read whole and checked is ready (evictable by the hints);
        a failed one is freed (a failed guess costs nothing more, counted wasted; a demanded one raises in its
        `get`); a read whose slot moved on (retired after a timeout) changes nothing (lock held). With no read
        started and not reaped, nothing can finish and no read time passes: nothing to ask the readers."""
        if not self._reads:
            return
        for read_id, error in self.readers.reap():
            read = self._reads.pop(read_id)
            self._demanded -= read.urgent
            slot = read.slot
            if slot.gen == read.gen and slot.state == LOADING:
                if error is None:
                    if self._narrow[read.key[0]]:
                        self._round(read.key[0], slot.index, self._narrow[read.key[0]])
                    slot.state = READY
                    self._mark_evictable(slot)
                    self.stats.ram.bytes_read += self.layouts[read.key[0]].slot_bytes
                    self.stats.ram.loads += 1
                else:
                    self._free_slot(slot)
            read.error, read.done = error, True
        busy = self.readers.busy()
        self.stats.ram.read_seconds += busy - self._busy_seen
        self._busy_seen = busy
        self._flush()

    def _wait(self, reads: list[_Read]) -> float:
        """Wait for `reads`, in order, each up to the timeout (without the pager's lock), then take them in with one
        `_reap`; returns the seconds waited (also counted as stall). The first of them that failed, or is not in
        (timed out: its slot is retired, its reader may still write into it), raises; the later ones are not waited."""
        started = time.perf_counter()
        waited_for = []
        for read in reads:
            waited_for.append(read)
            if not self.readers.wait(read.id, self.timeout):
                break
        with self.lock:
            self._reap()
            late = next((read for read in waited_for if not read.done), None)
            if late is not None:
                slot = late.slot
                if slot.gen == late.gen and slot.state == LOADING:  # the thread may still write into it: retire it
                    slot.gen += 1
                    if self.where.get(late.key) is slot:
                        self._forget(slot)
                    slot.state, slot.key = DEAD, None
                    self.lost_slots += 1
                    self.held = ()
            waited = time.perf_counter() - started
            self.stats.ram.stall_seconds += waited
        for read in waited_for:
            if read is late:
                ext = self.store.expert_extent(*read.key)
                raise ReadTimeoutError(f"layer {read.key[0]} expert {read.key[1]}: reading {ext.path} at offset "
                                       f"{ext.offset} did not finish within {self.timeout:g} s; check the disk (dmesg) "
                                       f"or raise the I/O timeout")
            if read.error is not None:
                raise read.error
        return waited

    def resident(self) -> set[Key]:
        with self.lock:
            self._reap()
            return {s.key for s in self.slots if s.state == READY}

    def close(self) -> None:
        with self.lock:
            self.readers.close(self.timeout)
        self.backend.close()
