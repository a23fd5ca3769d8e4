// Dense GEMV for decode on the CPU (AVX2 + FMA): y[N, O] = x[N, K] W^T (+ b), W [O, K] row-major
// in fp32 or bf16, x, b, y fp32, fp32 accumulation. Plain C ABI, built with the other CPU kernels
// into one library (kernels/_cpu/__init__.py) and run on its one pool (kernels/_cpu/pool.h).
//
// Decode reads every weight once per token, so the GEMV is a stream of W: each row is read from
// RAM once for all N tokens (groups of 8 tokens take turns on the row while it sits in L1/L2).
// bf16 weights widen exactly to fp32 in registers (zero-extend, shift left 16) and meet fp32 x:
// the result is x W^T with W's bf16 values, to fp32 rounding (torch's bf16 F.linear rounds x to
// bf16 too, and its GEMV ran at 5-6 GB/s here). A row is computed whole by one thread, so the
// bits do not depend on the thread count, and a token's summation order depends on K only (not on N:
// a token has the same bits alone or among others, dense_rows.h).
#include <cstdint>

#include "dense_rows.h"

using localmoe_dense::gemv;

extern "C" {

// y [N, O] = x [N, K] W^T (+ bias [O] unless null); W fp32 [O, K]; all contiguous.
void dense_gemv_f32(const float* x, int64_t N, int64_t K, const float* w, int64_t O, const float* bias, float* y,
                    int threads) {
  gemv<float>(x, N, K, w, O, bias, y, threads);
}

// The same with W bf16 [O, K] (as uint16 bits).
void dense_gemv_bf16(const float* x, int64_t N, int64_t K, const uint16_t* w, int64_t O, const float* bias,
                     float* y, int threads) {
  gemv<uint16_t>(x, N, K, w, O, bias, y, threads);
}

}  // extern "C"
