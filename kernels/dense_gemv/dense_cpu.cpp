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

namespace {

struct ReadArgs {
  const float* x;
  float* partial;
  int64_t chunk;
};

// Chunks [c0, c1) of x summed into partial[c] (4 independent accumulators: bound by the read, not the adds).
void read_chunks(const void* ctx, int64_t c0, int64_t c1) {
  const ReadArgs& a = *static_cast<const ReadArgs*>(ctx);
  for (int64_t c = c0; c < c1; ++c) {
    const float* p = a.x + c * a.chunk;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < a.chunk; i += 32) {
      s0 = _mm256_add_ps(s0, _mm256_loadu_ps(p + i));
      s1 = _mm256_add_ps(s1, _mm256_loadu_ps(p + i + 8));
      s2 = _mm256_add_ps(s2, _mm256_loadu_ps(p + i + 16));
      s3 = _mm256_add_ps(s3, _mm256_loadu_ps(p + i + 24));
    }
    a.partial[c] = localmoe::hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  }
}

}  // namespace

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

// partial [n / chunk] = sums of x's chunks of `chunk` floats (a multiple of 32; n a multiple of chunk): the
// plain read stream a GEMV's weight read is measured against (benchmarks/common.py memory_read_bandwidth).
void dense_read(const float* x, int64_t n, int64_t chunk, float* partial, int threads) {
  const ReadArgs args{x, partial, chunk};
  localmoe::parallel(read_chunks, &args, n / chunk, 1, threads);
}

}  // extern "C"
