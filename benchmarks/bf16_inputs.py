"""What bf16 arithmetic (llama.cpp's: every matrix input rounded to bf16, then bf16 x bf16 products) would do to a
model's logits under `--dtype bfloat16`, where localmoe keeps activations in fp32 (its dense GEMV and dense-expert
kernels widen the bf16 weights exactly and multiply fp32 x).

One process: the prompt's logits at every position (one prefill chunk) from the engine as it is, then with the input
of every dense matrix (`Linear`) and of every dense routed expert's matrices (gate / up and down) rounded to bf16
(the rounded experts in torch, one expert at a time), then, as a control, the same torch experts without the rounding
(it should sit at fp32 rounding, ~1e-6 of the range). Printed: max and median over positions of max |delta| / the
position's logit range, and how many positions keep their argmax. The issue's rule for fused paths is 1e-5.

    python benchmarks/bf16_inputs.py --model path/to/qwen3_next-small-bf16.gguf
"""

from __future__ import annotations

import argparse
import random

import torch

from localmoe.config import EngineConfig
from localmoe.engine import linear
from localmoe.engine.layers import moe
from localmoe.kernels.mxfp4_moe import glu
from localmoe.load import load_model


def torch_experts(rounded: bool):
    """A stand-in for `moe.dense_moe_layer`: each expert of the run in torch, inputs rounded to bf16 or not."""

    def layer(x, ids, weights, table, experts, kind, params, out):
        flat = ids.reshape(-1)
        for e in experts:
            picks = (flat == e).nonzero().squeeze(1)
            rows, w = picks // ids.shape[1], weights.reshape(-1)[picks].float()
            gate, up, down = (m.float() for m in table.experts[e])
            xs = x[rows].bfloat16().float() if rounded else x[rows]
            h = glu(kind, xs @ gate.T, xs @ up.T, *params)
            h = h.bfloat16().float() if rounded else h
            out.index_add_(0, rows, (h @ down.T) * w[:, None])
        return out

    return layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint with bf16 dense matrices (e.g. a bf16 GGUF)")
    parser.add_argument("--prompt", type=int, default=72)
    args = parser.parse_args()
    torch.set_num_threads(1)
    T = args.prompt
    config = EngineConfig(dtype="bfloat16", threads=1, max_context=T + 16)
    model = load_model(args.model, config, progress=False).model
    rng = random.Random(0)
    prompt = torch.tensor([[rng.randrange(10, 600) for _ in range(T)]])

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            return model.forward(prompt, model.new_cache(1, T + 16), all_logits=True)[0].float()

    engine = logits()
    call, layer = linear.Linear.__call__, moe.dense_moe_layer
    linear.Linear.__call__ = lambda self, x: call(self, x.bfloat16().float() if x.dtype == torch.float32 else x)
    moe.dense_moe_layer = torch_experts(rounded=True)
    try:
        rounded = logits()
        linear.Linear.__call__ = call
        moe.dense_moe_layer = torch_experts(rounded=False)
        control = logits()
    finally:
        linear.Linear.__call__, moe.dense_moe_layer = call, layer
    span = engine.amax(-1) - engine.amin(-1)
    for name, other in (("inputs rounded to bf16", rounded), ("control (torch experts, fp32 inputs)", control)):
        delta = (engine - other).abs().amax(-1) / span
        same = int((engine.argmax(-1) == other.argmax(-1)).sum())
        print(f"{name}: max |delta| / range over {T} positions {delta.max():.2e} (median {delta.median():.2e}), "
              f"argmax equal at {same}/{T}")


if __name__ == "__main__":
    main()
