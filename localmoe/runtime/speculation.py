"""The served model's speculative decoding (`--spec prompt|draft:PATH|mtp|off`): what drafts, one
`Speculator` per sequence (engine/spec), and the statistics of all of them for --stats and /metrics.

- `prompt`: prompt lookup (n-grams of the prompt and the generated text), no model;
- `draft:PATH`: a smaller model localmoe loads, which must share the target's tokenizer (checked: the
  same vocabulary and ids, else an error naming both); each sequence gets its own draft cache; on a paged
  target it drafts the next step in a thread while the target's verify waits on reads, and ends a draft
  before its first unsure token (draft_model.py);
- `prompt+draft:PATH`: prompt lookup where the sequence's last tokens have a long earlier match (a quote in
  progress), the draft model `draft:PATH` elsewhere (engine/spec/hybrid.py);
- `mtp`: the checkpoint's next-n prediction layer (DeepSeek-V3 / V3.2, GLM-4.5: `num_nextn_predict_layers`;
  engine/nextn.py, engine/spec/mtp.py), loaded only then; each sequence gets its own small cache of it.
  HF checkpoints, stores converted from them (the layer's routed experts as extents, read through the store's
  pager like any layer's), and GGUF files (llama.cpp's `blk.{L}.nextn.*`). A checkpoint
  without one (Kimi K3: 0), or one whose layer localmoe does not read (Qwen3-Next's `mtp.*`, a store
  converted from a GGUF), says so and runs without speculation;
- `off`;
- `auto`: prompt lookup where it measured faster (a model whose weights all sit in RAM and run on the CPU:
  1.2-2.1x on quoting answers, never slower on free ones, docs/performance.md "Speculative decoding"), off
  elsewhere (a paged store: parity to 1.4x by task, below 1x on random-weight routing; the GPU: not measured).

With `price_experts` on a paged model a prompt-lookup sequence also gets a `Residency`
(engine/spec/residency.py): the routers record each forward's choices, so a draft copied from the sequence
predicts its experts, the speculator prices the reads the pager would need and the pager prefetches them.
It is off by default: on the paged store of docs/paging.md it did not beat pricing by step time.

Constrained generation (forced tool calls, structured output) does not speculate: its grammar masks
each position's logits after the previous token is chosen.
"""

from __future__ import annotations

import sys
import threading

from localmoe.config import SPEC_K
from localmoe.engine.spec.draft_model import CONFIDENT, DraftModel, check_vocab
from localmoe.engine.spec.drafters import PromptLookup
from localmoe.engine.spec.hybrid import LookupThenModel
from localmoe.engine.spec.mtp import MTPDrafter
from localmoe.engine.spec.residency import Residency, RouteBook
from localmoe.engine.spec.speculator import K_MAX, SpecStats, Speculator
from localmoe.errors import LocalMoEError
from localmoe.paging.metrics import pager_of

SPEC_CHOICES = "auto | prompt | draft:PATH | prompt+draft:PATH | mtp | off"
DRAFTING = ("draft", "prompt+draft")  # the modes that run a draft model


def mtp_layers(loaded) -> int | None:
    """The next-n prediction layers a checkpoint declares: `ModelSpec.nextn_layers` where the family records
    them (DeepSeek-V3, GLM-4.5: skipped on load), else config.json `num_nextn_predict_layers` (Kimi) or
    `mtp_num_hidden_layers` (Qwen3-Next), GGUF `<arch>.nextn_predict_layers`; None where nothing says."""
    from localmoe.checkpoint import open_checkpoint

    if loaded.spec.nextn_layers:
        return loaded.spec.nextn_layers
    try:
        ckpt = open_checkpoint(loaded.source)
    except LocalMoEError:
        return None
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        if key in ckpt.config:
            return int(ckpt.config[key])
    for key, value in (ckpt.gguf_metadata or {}).items():
        if key.endswith(".nextn_predict_layers"):
            return int(value)
    return None


def resident_on_cpu(loaded) -> bool:
    """Whether every weight of `loaded` sits in RAM and runs on the CPU (no pager, no GPU tier): where prompt
    lookup measured faster than no speculation on every task, `--spec auto`'s test."""
    config = loaded.config
    return pager_of(loaded) is None and config.device == "cpu" and not config.paging.gpu_budget


class Speculation:
    """`mode` is one of "prompt", "draft", "prompt+draft", "mtp", "off" once built (`mtp` without a layer to load
    resolves to "off" with a message)."""

    def __init__(self, loaded, option: str = "off", k: int = SPEC_K, adaptive: bool = True, warn=None,
                 price_experts: bool = False):
        self.k, self.adaptive = k, adaptive
        self.draft = None  # the draft model's LoadedModel
        self.head = None  # the MTP layer (engine/nextn.py NextN)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer  # prompt lookup matches near-quotes by the tokens' text
        # price_experts on a paged model: prompt lookup prices its drafts' expert reads (off by default: no gain
        # measured over pricing by step time, docs/paging.md "A paged store that quotes")
        self.pager = pager_of(loaded) if price_experts else None
        self.paged = pager_of(loaded) is not None
        self.book: RouteBook | None = None
        self.stats = SpecStats()  # every finished sequence's, added up
        self._lock = threading.Lock()
        warn = warn or (lambda message: print(f"localmoe: {message}", file=sys.stderr))
        option = (option or "off").strip()
        if not 1 <= k <= K_MAX:
            raise LocalMoEError(f"--spec-k must be between 1 and {K_MAX}, not {k}")
        if option in ("off", "prompt"):
            self.mode = option
        elif option == "auto":
            self.mode = "prompt" if resident_on_cpu(loaded) else "off"
        elif option == "mtp":
            self.mode = self._mtp(loaded, warn)
        elif option.partition(":")[0] in DRAFTING and option.partition(":")[2]:
            from localmoe.load import load_model

            mode, _, path = option.partition(":")
            self.draft = load_model(path, loaded.config, progress=False)
            check_vocab(loaded.tokenizer, self.draft.tokenizer, str(loaded.source), path)
            self.vocab = loaded.spec.vocab_size
            self.mode = mode
        else:
            raise LocalMoEError(f"--spec {option!r}: expected {SPEC_CHOICES}")

    def _mtp(self, loaded, warn) -> str:
        from localmoe.errors import UnsupportedModelError
        from localmoe.load import load_nextn

        n = mtp_layers(loaded)
        name = getattr(loaded.source, "name", None) or str(loaded.source)
        if not n:
            warn(f"--spec mtp: {name} has no multi-token-prediction heads (num_nextn_predict_layers = "
                 f"{n or 0}); running without speculation (try --spec prompt or --spec draft:PATH)")
            return "off"
        if not loaded.spec.nextn_layers:
            warn(f"--spec mtp: {name} has {n} multi-token-prediction layer(s), but localmoe does not read this "
                 f"family's ({loaded.spec.model_type}); running without speculation (try --spec prompt or "
                 "--spec draft:PATH)")
            return "off"
        try:
            self.head = load_nextn(loaded)
        except UnsupportedModelError as e:
            warn(f"--spec mtp: {e}; running without speculation")
            return "off"
        return "mtp"

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def new(self, mode: str | None = None) -> Speculator | None:
        """A speculator for one sequence (None: no speculation). `mode`: a request's own choice, "off" or
        this server's mode (a draft model must have been loaded at start)."""
        mode = self.mode if mode is None else mode
        if mode == "off":
            return None
        if mode in DRAFTING and self.draft is None or mode == "mtp" and self.head is None or \
                mode not in ("prompt", "mtp", *DRAFTING):
            raise LocalMoEError(f"spec {mode!r} is not available here (the server runs --spec {self.mode}); "
                                "ask for 'off', 'prompt' or the server's mode")
        if mode == "mtp":
            drafter = MTPDrafter(self.head)
        else:
            # a paged target's verify waits on reads: the draft model drafts the next step beside it (draft_model.py)
            drafter = PromptLookup(tokenizer=self.tokenizer) if mode == "prompt" else \
                DraftModel(self.draft.model, self.vocab, ahead=self.paged, confident=CONFIDENT if self.paged else 0.0)
            if mode == "prompt+draft":
                drafter = LookupThenModel(PromptLookup(tokenizer=self.tokenizer), drafter)
        residency = Residency(self.pager, self._routes()) if mode == "prompt" and self.pager is not None else None
        return Speculator(drafter, self.k, self.adaptive, residency)

    def _routes(self) -> RouteBook:
        """The paged model's routers, recording each forward's choices for the residency cost model (once)."""
        if self.book is None:
            from localmoe.paging import attach

            self.book = RouteBook()
            attach(self.model, self.pager, trace=self.book, lookahead=self.pager.prefetch_enabled)
        return self.book

    def finished(self, stats: SpecStats) -> None:
        """Add a finished sequence's statistics to the totals (/metrics)."""
        with self._lock:
            self.stats.add(stats)


def spec_line(stats: SpecStats, pager=None, generated: int = 0) -> str:
    """One line for --stats: acceptance, tokens per step and, with a pager, expert bytes read per generated
    token (all the pager read since it started, prompt included, over the tokens generated)."""
    line = (f"speculation: {stats.accepted}/{stats.drafted} drafts kept ({100 * stats.acceptance:.0f}%), "
            f"{stats.tokens_per_step:.2f} tokens per step over {stats.steps} steps")
    if pager is not None and generated:
        read = sum(tier.bytes_read for tier in pager.stats.tiers.values())
        line += f", {read / generated / 1e6:.1f} MB of experts read per generated token"
    return line
