"""Weight codecs, a leaf of the layering (nothing here imports the rest of localmoe but `errors`):

- `mxfp4`: OCP MXFP4 quantise / dequantise and the lossless layout repacks (gpt-oss, ggml)
- `ggml`: dequantisation of GGUF's block types (Q4_0 ... Q6_K, MXFP4) in torch
- `fp8`: block-scaled FP8 weights (DeepSeek's `weight_scale_inv`) to float32

Kernels, the engine, the families and the store all import these; the FP8 KV-cache codec is a
kernel (`localmoe.kernels.fp8_cache`).
"""
