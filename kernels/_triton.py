"""Whether the Triton kernels can run on a tensor: Triton installed and the tensor on a GPU.

(The tests also run the kernels on CPU tensors under TRITON_INTERPRET=1, calling them directly;
the dispatchers never route CPU tensors to the interpreter.)
"""

from __future__ import annotations

import importlib.util

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def usable(t: torch.Tensor) -> bool:
    """True where a dispatcher should run the Triton kernel for `t`."""
    return HAVE_TRITON and t.is_cuda
