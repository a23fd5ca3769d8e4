"""KDA and Gated DeltaNet on CUDA through flash-linear-attention (the `fla-core` package, the `gpu` extra):
the kernels the model authors and vLLM / SGLang run. Our Triton kernels stay the fallback where fla is not
installed or does not import; the PyTorch references stay the CPU path and the oracle.

Our contract (kernels/kda/reference.py) maps onto fla's ops as:
- q and k arrive l2-normalised and q already scaled: `scale=1.0`, `use_qk_l2norm_in_kernel=False`;
- g is the log-decay, computed by the layer (K3's bounded gate included): `use_gate_in_kernel=False`;
  where the caller knows g lies in [lower_bound, 0) (K3: lower_bound * sigmoid(...)), chunk_kda may take
  `safe_gate=True, lower_bound=...` (its faster bounded-gate path);
- beta is already a sigmoid: `use_beta_sigmoid_in_kernel=False`;
- state [B, H, K, V] fp32 is fla's `initial_state` [N, HV, K, V] (K-first: `state_v_first=False`), and
  `output_final_state=True` returns the new one;
- fla returns o in v's dtype: the dispatchers return fp32 like every other path.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

OPS = ("chunk_kda", "fused_recurrent_kda", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")
FLA_VERSION = "0.6"  # the version measured (on an H200, torch 2.11 + Triton 3.6); pyproject's `gpu` extra


@functools.cache
def ops() -> dict | None:
    """fla's four ops by name, or None where fla-core is not installed or does not import."""
    try:
        if importlib.util.find_spec("fla") is None:
            return None
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception:  # noqa: BLE001 - a broken or mismatched install falls back to our kernels
        return None
    return dict(zip(OPS, (chunk_kda, fused_recurrent_kda, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)))


def fla_arguments(op: str, q, k, v, g, beta, state: torch.Tensor, lower_bound: float | None = None) -> dict:
    """Keyword arguments of fla's `op` for our (q, k, v, g, beta, state) (shapes as reference.py; g [B, T, H, K]
    for KDA, [B, T, H] for Gated DeltaNet). All keywords: fla's recurrent Gated DeltaNet takes gk and gv
    between g and beta."""
    if op not in OPS:
        raise ValueError(f"fla op {op!r} is not one of {', '.join(OPS)}")
    gated_delta = "gated_delta" in op
    B, T, H, K = q.shape
    assert k.shape == q.shape and v.shape[:3] == (B, T, H) and beta.shape == (B, T, H)
    assert g.shape == ((B, T, H) if gated_delta else (B, T, H, K)), f"g {tuple(g.shape)} for {op}"
    assert state.shape == (B, H, K, v.shape[-1])
    kwargs = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "scale": 1.0, "initial_state": state.float(),
              "output_final_state": True, "use_qk_l2norm_in_kernel": False}
    if op == "chunk_kda" and lower_bound is not None:
        kwargs.update(safe_gate=True, lower_bound=lower_bound)
    return kwargs


def run(op: str, q, k, v, g, beta, state, lower_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's `op` under our contract: (o [B, T, H, V] fp32, state [B, H, K, V] fp32). Needs `ops()`."""
    o, new_state = ops()[op](**fla_arguments(op, q, k, v, g, beta, state, lower_bound))
    return o.float(), new_state.float()
