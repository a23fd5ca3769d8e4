// GEMV straight from GGUF block formats on the CPU (AVX2 + FMA + F16C): y[N, O] = x[N, K] W^T (+ b),
// W as the file stores it, row-major raw blocks of 32 weights:
//   Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles          w = d (q - 8)
//   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles  w = d q + m
//   Q8_0 (34 bytes): fp16 d, 32 int8                      w = d q
// nibble byte j holds element j (low) and j + 16 (high); and the K-quants, super-blocks of 256:
//   Q5_0 (22 bytes), Q5_1 (24 bytes): Q4_0 / Q4_1 with 32 fifth bits   w = d (q - 16), w = d q + m
//   Q4_K (144 bytes): 8 sub-blocks of 32 with 6-bit scale and min   w = d sc q - dmin m
//   Q5_K (176 bytes): Q4_K with a fifth bit per value
//   Q6_K (210 bytes): 16 sub-blocks of 16 with int8 scale, 6-bit q  w = d scale (q - 32)
// (layouts: ggml_rows.h). Like llama.cpp, each token's x is rounded to int8 first, per 32 values for blocks of 32
// (BlockX: step d = amax / 127, q = round-to-even(x / d), and d * sum(q)), per 256 for the K-quants (BlockXK);
// a block's dot product is then integer (vpmaddubsw of u8 nibbles with s8 x, or |w| with sign-moved
// x for Q8_0) and one FMA by d_w * d_x; Q4_0's -8 and Q4_1's m are applied through d * sum(q) of x.
// torch's int4 GEMV, which the engine used before, ran the embedded model's 4-bit matrices at
// ~7 GB/s on 2 cores. Rows are computed whole by one thread: the bits do not depend on the threads.
// N tokens (a batched decode step): each weight block is decoded once per tile of 8 tokens (AVX-512
// VNNI; 4 on AVX2) and applied to all of them, where the first version decoded it again per token
// (3072 x 576 Q4_1, one core: ~2.0 cycles per block and token at N >= 8 against ~5.2 for one token;
// benchmarks/ggml_gemm.py). Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 go further (rows8): eight weight rows share each vector, one lane
// per row, so a block's conversion and FMAs serve eight rows at once (3072 x 576 Q4_1: ~1.2 cycles per block and
// token at 16 tokens, ~2.6-2.9 for one, against ~2.25 and ~5.4 per row). A token's result has the same bits
// whatever N is, and whichever rows share the call (ggml_rows.h).
#include <cstdint>

#include "ggml_rows.h"

using namespace localmoe_ggml;

extern "C" {

// Bytes of scratch ggml_gemv needs for N tokens of K.
int64_t ggml_gemv_scratch(int64_t N, int64_t K) { return scratch_bytes(N, K); }

// y [N, O] = x [N, K] W^T (+ bias [O] unless null); W raw blocks [O, row_bytes] of `type` (2 Q4_0,
// 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K; 259 Q4_1_R8, 268 Q4_K_R8, 270 Q6_K_R8: repacked, O a
// multiple of 8; 264 Q8_0_R16: x_mode 2 only, O a multiple of 16); K a
// multiple of 32 (256 for K-quants);
// everything contiguous.
// x_mode (ggml_rows.h XMode): 0 x rounded to int8 per block, 1 fp32 x as it is (exact_x: Q8_0, Q4_K, Q6_K; scratch
// unused), 2 x rounded to int16 per 32 (Q8_0). Returns 0, or -1 for an unknown type, a K that is not a whole number
// of blocks, or a mode the type does not have.
int ggml_gemv(const float* x, int64_t N, int64_t K, const uint8_t* w, int type, int64_t O, const float* bias,
              float* y, void* scratch, int threads, int x_mode) {
  if (row_bytes(type, K / kBlock) == 0 || K % (is_k_quant(type) ? 256 : kBlock) || !has_x_mode(type, x_mode) ||
      ((type & kRepacked) && O % (type == kQ8_0_R16 ? kQ80R16Rows : 8)))
    return -1;
  gemv(x, N, K, w, type, O, bias, y, scratch, threads, x_mode);
  return 0;
}

// Q4_1 / Q4_K / Q6_K rows [O, row_bytes(type, K / 32)] (O a multiple of 8) into Q4_1_R8 / Q4_K_R8 / Q6_K_R8 (`pack`
// 1; ggml_rows.h, ggml_rows8_k.h, ggml_rows8_q6k.h), Q8_0 ones (O a multiple of 16) into Q8_0_R16, or back (0), src
// may be dst; tmp: 8 row_bytes (Q8_0: 16). Returns 0, or -1 for another type or shape.
int ggml_repack(const uint8_t* src, uint8_t* dst, int64_t O, int64_t K, int type, int pack, uint8_t* tmp) {
  if (type == kQ8_0 && O % kQ80R16Rows == 0 && K % kBlock == 0) {  // into Q8_0_R16 (16 rows a group)
    repack_q80(src, dst, O, K / kBlock, pack != 0, tmp);
    return 0;
  }
  if (type == kQ4_1 && O % 8 == 0 && K % kBlock == 0) {
    repack_q41(src, dst, O, K / kBlock, pack != 0, tmp);
    return 0;
  }
  if ((type != kQ4_K && type != kQ6_K) || O % 8 || K % 256) return -1;
  (type == kQ4_K ? repack_q4k : repack_q6k)(src, dst, O, K / 256, pack != 0, tmp);
  return 0;
}

// Rows ids[0..n) of a table of GGUF blocks (rows of row_bytes, K values each) dequantised into out [n, K] fp32 with
// the values and operations of quant/ggml.py (gguf's numpy reference: (d * sc) * q - dmin * m for Q4_K / Q5_K,
// (d * scale) * (q - 32) for Q6_K, d * q for Q8_0; no fused multiply-add: ISO C++ leaves contraction off), so
// the bits of a whole-table dequantisation: a BlockEmbedding's lookup (Q8_0_R16 too: a tied x16 head's table).
// Returns 0, or -1 for another type.
int ggml_dequantize_rows(const uint8_t* table, int64_t row_bytes, const int64_t* ids, int64_t n, int type, int64_t K,
                         float* out) {
  if (type != kQ8_0 && type != kQ4_K && type != kQ5_K && type != kQ6_K && type != kQ8_0_R16) return -1;
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* row = table + ids[r] * row_bytes;
    float* y = out + r * K;
    if (type == kQ8_0_R16) {  // row ids[r] % 16 of its group (ggml_rows.h repack_q80): the same values as Q8_0's
      const int64_t nb = K / kBlock, lane = ids[r] % kQ80R16Rows;
      const uint8_t* group = table + (ids[r] - lane) * row_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        const float d = half(group + 512 * nb + 32 * b + 2 * lane);
        for (int i = 0; i < 32; ++i)
          y[32 * b + i] = d * static_cast<float>(static_cast<int8_t>(group[512 * b + 64 * (i / 4) + 4 * lane + i % 4]));
      }
      continue;
    }
    if (type == kQ8_0) {
      for (int64_t b = 0; b < K / kBlock; ++b) {
        const uint8_t* blk = row + 34 * b;
        const float d = half(blk);
        for (int i = 0; i < 32; ++i) y[32 * b + i] = d * static_cast<float>(static_cast<int8_t>(blk[2 + i]));
      }
      continue;
    }
    for (int64_t b = 0; b < K / 256; ++b) {
      float* v = y + 256 * b;
      if (type == kQ6_K) {
        const uint8_t* blk = row + 210 * b;
        const float d = half(blk + 208);
        alignas(32) int8_t q[32];
        for (int c = 0; c < 8; ++c) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(q), q6_k_codes(blk, c));  // q - 32
          for (int i = 0; i < 32; ++i) {
            const float scale = d * static_cast<float>(static_cast<int8_t>(blk[192 + (32 * c + i) / 16]));
            v[32 * c + i] = static_cast<float>(q[i]) * scale;
          }
        }
        continue;
      }
      const bool fifth = type == kQ5_K;
      const uint8_t* blk = row + (fifth ? 176 : 144) * b;
      const uint8_t* nibbles = blk + (fifth ? 48 : 16);
      uint64_t sc, mn;
      q4_k_scales(blk + 4, sc, mn);
      const float d = half(blk), dmin = half(blk + 2);
      for (int j = 0; j < 8; ++j) {
        const float scale = d * static_cast<float>((sc >> (8 * j)) & 0xFF);
        const float offset = dmin * static_cast<float>((mn >> (8 * j)) & 0xFF);
        for (int i = 0; i < 32; ++i) {
          int q = (nibbles[32 * (j / 2) + i] >> (4 * (j % 2))) & 0x0F;
          if (fifth) q |= ((blk[16 + i] >> j) & 1) << 4;
          v[32 * j + i] = static_cast<float>(q) * scale - offset;
        }
      }
    }
  }
  return 0;
}

}  // extern "C"
