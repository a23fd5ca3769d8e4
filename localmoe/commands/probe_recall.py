"""`localmoe probe-recall`: does the fact a question needs fall within the tokens sparse attention keeps?

A needle (a fact with a number) is planted at chosen depths of a generated filler document;
the model is asked for the number. For each depth the probe reports the greedy answer,
whether it holds the number, and per sparse layer which share of the needle's number tokens
the LAST prompt position (the one whose output is the first answer token) kept in its top-k:
for DSA layers the indexer's selection, for dense MLA/GQA layers under `--sparse-topk` the
union over heads of the top-k attention scores. Sparse-attention deployment guidance asks
users to check that critical information falls within the selected tokens instead of trusting
the nominal context length; this is that check.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field

import click

from localmoe.commands.base import Command
from localmoe.errors import LocalMoEError

COLOURS = ("red", "green", "blue", "grey", "yellow", "white", "black", "brown")
ANIMALS = ("fox", "horse", "heron", "otter", "badger", "lynx", "crow", "goat")
PLACES = ("mill", "bridge", "harbour", "library", "orchard", "station", "market", "chapel")
NEEDLE = "The secret code of the blue vault is {code}."
QUESTION = "What is the secret code of the blue vault? Answer with the number only."


@dataclass
class DepthResult:
    depth: float  # requested fraction of the document before the needle
    needle_positions: list[int]  # prompt positions of the number's tokens
    answer: str
    correct: bool
    recall: dict[str, float] = field(default_factory=dict)  # "layer i" -> share of needle tokens selected


def filler(sentences: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"The {rng.choice(COLOURS)} {rng.choice(ANIMALS)} walked past the {rng.choice(PLACES)} at "
            f"{rng.randint(1, 12)} o'clock." for _ in range(sentences)]


def document(tokenizer, context: int, depth: float, code: str, seed: int) -> str:
    """About `context` tokens of filler with the needle after `depth` of them."""
    sample = filler(32, seed)
    per_sentence = len(tokenizer.encode(" ".join(sample), add_special_tokens=False)) / len(sample)
    sentences = filler(max(1, int(context / per_sentence)), seed)
    at = round(depth * len(sentences))
    return " ".join(sentences[:at] + [NEEDLE.format(code=code)] + sentences[at:])


def find_tokens(prompt: list[int], tokenizer, text: str) -> list[int]:
    """Positions of `text`'s tokens in `prompt` (tried with and without a leading space)."""
    for variant in (" " + text, text):
        ids = tokenizer.encode(variant, add_special_tokens=False)
        for start in range(len(prompt) - len(ids), -1, -1):
            if prompt[start:start + len(ids)] == ids:
                return list(range(start, start + len(ids)))
    raise LocalMoEError(f"probe-recall: the needle {text!r} is not found as tokens in the prompt; the tokenizer "
                        "split it with its neighbours (try another --code)")


def sparse_layers(model) -> dict[int, object]:
    """Mixers that select: DSA layers, and dense MLA/GQA layers when `sparse_topk` is set."""
    from localmoe.engine.layers.dsa import DSAttention

    found = {}
    for i, (_, mixer, _, _) in enumerate(model.layers):
        if isinstance(mixer, DSAttention) or getattr(mixer, "sparse_topk", None) is not None:
            found[i] = mixer
    if not found:
        raise LocalMoEError("probe-recall: this model has no sparse layer; give --sparse-topk N for a dense "
                            "attention model, or a DSA model (DeepSeek-V3.2)")
    return found


def selected_positions(mixer) -> set[int]:
    """Cache positions the last query of the latest call kept (batch row 0, all heads)."""
    selection = mixer.last_selection
    if selection is None:  # a dense layer that saw no more keys than its top-k: everything is kept
        return set()
    last = selection[0, -1] if selection.dim() == 3 and hasattr(mixer, "indexer") else selection[0].reshape(-1)
    return {int(i) for i in last.tolist() if i >= 0}


def probe(loaded, depths: list[float], context: int, code: str = "7481", max_tokens: int = 24, seed: int = 0,
          progress=None) -> list[DepthResult]:
    """Run the probe at each depth (the answer: the runtime's greedy completion of the chat prompt);
    `progress(i, n)` after each depth."""
    from localmoe.engine.sampler import SamplingParams
    from localmoe.runtime.local import LocalModel

    runtime = LocalModel(loaded)
    model, tokenizer = loaded.model, loaded.tokenizer
    layers = sparse_layers(model)
    results = []
    for n, depth in enumerate(depths):
        if not 0.0 <= depth <= 1.0:
            raise LocalMoEError(f"probe-recall: depth {depth} is outside 0..1 (a fraction of the document)")
        text = document(tokenizer, context, depth, code, seed)
        prompt = loaded.chat_prompt([{"role": "user", "content": f"{text}\n\n{QUESTION}"}])
        needle = find_tokens(prompt, tokenizer, code)
        recall: dict[str, float] = {}

        def prompt_done(needle=needle, recall=recall) -> None:
            """The prompt's last chunk ran: its last position's selection is each layer's latest."""
            for i, mixer in layers.items():
                kept = selected_positions(mixer)
                everything = mixer.last_selection is None
                recall[f"layer {i}"] = 1.0 if everything else sum(p in kept for p in needle) / len(needle)
                mixer.record_selection, mixer.last_selection = False, None

        for mixer in layers.values():
            mixer.record_selection, mixer.last_selection = True, None
        try:
            answer = runtime.complete(prompt, SamplingParams(temperature=0.0), max_tokens, on_prompt=prompt_done)
        finally:
            for mixer in layers.values():
                mixer.record_selection, mixer.last_selection = False, None
        reply = answer.content.strip()
        results.append(DepthResult(depth, needle, reply, code in reply, recall))
        if progress is not None:
            progress(n + 1, len(depths))
    return results


def report(results: list[DepthResult]) -> str:
    lines = []
    for r in results:
        layers = ", ".join(f"{name}: {share:.0%}" for name, share in r.recall.items())
        lines.append(f"depth {r.depth:.2f} (needle at token {r.needle_positions[0]}): answer {r.answer!r} "
                     f"{'right' if r.correct else 'wrong'}; needle selected in {layers}")
    return "\n".join(lines)


@click.command("probe-recall", cls=Command)
@click.option("--model", "-m", "model", default=None, metavar="PATH",
              help="GGUF file, HF model directory or packed store (default: the embedded model).")
@click.option("--depths", default="0.1,0.5,0.9", show_default=True,
              help="Comma-separated fractions of the document before the needle.")
@click.option("--context", type=int, default=1024, show_default=True, help="Document length in tokens (about).")
@click.option("--sparse-topk", type=int, default=None, metavar="N",
              help="For dense MLA/GQA models: attend to each query's N best-scoring cached tokens.")
@click.option("--code", default="7481", show_default=True, help="The number the needle holds.")
@click.option("--max-tokens", type=int, default=24, show_default=True, help="Greedy answer length limit.")
@click.option("--threads", type=int, default=0, help="CPU threads (default: physical cores).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def command(model, depths, context, sparse_topk, code, max_tokens, threads, as_json):
    """Plant a needle at each depth of a long generated document, ask for it, and report per sparse
    layer whether the needle's tokens were among the selected top-k, and whether the answer was right."""
    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    try:
        fractions = [float(d) for d in depths.split(",") if d.strip()]
    except ValueError:
        raise click.BadParameter(f"{depths!r}: give fractions such as 0.1,0.5,0.9", param_hint="--depths") from None
    config = EngineConfig(dtype="float32", threads=threads, max_context=context + context // 2 + 256,
                          sparse_topk=sparse_topk)
    loaded = load_model(model, config)

    def progress(i: int, n: int) -> None:
        click.echo(f"probe-recall: depth {i}/{n} done", err=True)

    results = probe(loaded, fractions, context, code, max_tokens, progress=progress)
    click.echo(json.dumps([asdict(r) for r in results], indent=2) if as_json else report(results))


def main() -> None:
    command(prog_name="localmoe probe-recall")
