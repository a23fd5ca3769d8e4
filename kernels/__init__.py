"""Compute kernels (installed as `localmoe.kernels`).

Each op lives in `kernels/<op>/` with `reference.py` (the spec in plain PyTorch),
`triton.py` (the GPU kernel) and an `__init__.py` dispatcher that falls back to the
reference where Triton or a GPU is missing. The engine imports only dispatchers.
"""
