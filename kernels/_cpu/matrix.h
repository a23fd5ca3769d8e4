// A weight matrix as the fused decode steps read it: fp32 or bf16 rows (dense_rows.h) or GGUF
// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks (ggml_rows.h), with an optional fp32 bias; `matvec` is y = W x (+ b)
// for one token through the right GEMV on the library's pool, `matrows` the same for N tokens.
#pragma once

#include <cstdint>

#include "../dense_gemv/dense_rows.h"
#include "../ggml_gemv/ggml_rows.h"

namespace localmoe {

// kStacked: `data` points to an array of Matrix parts over the same input, ended by one with rows == 0;
// their outputs are stacked (`rows` is the sum) and each part has its own bias. For a GGUF q; k; v
// whose parts differ in type (Q4_K_M files keep some attn_v in Q6_K).
enum MatrixType : int64_t { kF32 = 0, kBF16 = 1, kGgmlQ4_0 = 2, kGgmlQ4_1 = 3, kGgmlQ5_0 = 6, kGgmlQ5_1 = 7,
                            kGgmlQ8_0 = 8, kGgmlQ4_K = 12, kGgmlQ5_K = 13, kGgmlQ6_K = 14, kStacked = 255 };

struct Matrix {
  const void* data;
  int64_t type, rows, cols;
  const float* bias;  // [rows] or null
};

// A GGUF block type with kX16 added: the matrix reads x rounded to int16 per 32 values (Q8_0: ggml_rows.h x16, a dense
// model's lm_head) instead of int8.
constexpr int64_t kX16 = 0x1000;

inline int ggml_type(const Matrix& m) { return static_cast<int>(m.type & ~kX16); }
inline int x_mode(const Matrix& m) { return m.type & kX16 ? localmoe_ggml::kXInt16 : localmoe_ggml::kXInt8; }

inline void ggml_matrix(const Matrix& m, const float* x, int64_t n, float* y, void* scratch, int threads) {
  localmoe_ggml::gemv(x, n, m.cols, static_cast<const uint8_t*>(m.data), ggml_type(m), m.rows, m.bias, y, scratch,
                      threads, x_mode(m));
}

// Whether every part of a stacked matrix is GGUF blocks that read x rounded the same way (localmoe_ggml::rounding: a
// Q4_K_M file's q, k in Q4_K and v in Q6_K read one per-256 rounding; gate Q5_0 and up Q5_1 one per-32 rounding).
inline bool one_rounding(const Matrix& m) {
  const Matrix* part = static_cast<const Matrix*>(m.data);
  const int first = localmoe_ggml::rounding(ggml_type(*part), x_mode(*part));
  for (; part->rows > 0; ++part)
    if (part->type == kF32 || part->type == kBF16 || part->type == kStacked ||
        localmoe_ggml::rounding(ggml_type(*part), x_mode(*part)) != first)
      return false;
  return true;
}

// A one_rounding stacked matrix over N tokens: each slice of up to `slice` tokens' x rounded once (not once per part,
// the same values), then every part's rows straight into its columns of y.
inline void stacked_rows(const Matrix& m, const float* x, int64_t N, float* y, void* scratch, int threads,
                         int64_t slice) {
  const Matrix* parts = static_cast<const Matrix*>(m.data);
  for (int64_t t = 0; t < N; t += slice) {
    const int64_t n = N - t < slice ? N - t : slice;
    const float* xs = x + t * m.cols;
    const localmoe_ggml::XQ xq = localmoe_ggml::round_for(xs, n, m.cols, ggml_type(*parts), scratch, x_mode(*parts));
    int64_t at = 0;
    for (const Matrix* part = parts; part->rows > 0; at += part->rows, ++part)
      localmoe_ggml::gemv_rounded(xq, xs, n, m.cols, static_cast<const uint8_t*>(part->data), ggml_type(*part),
                                  part->rows, part->bias, y + t * m.rows + at, m.rows, threads, x_mode(*part));
  }
}

// Bytes of scratch `matvec` needs for inputs of up to K values.
inline int64_t matvec_scratch(int64_t K) { return localmoe_ggml::scratch_bytes(1, K); }

inline void matvec(const Matrix& m, const float* x, float* y, void* scratch, int threads) {
  if (m.type == kStacked && one_rounding(m)) {
    stacked_rows(m, x, 1, y, scratch, threads, 1);
  } else if (m.type == kStacked) {
    for (const Matrix* part = static_cast<const Matrix*>(m.data); part->rows > 0; y += part->rows, ++part)
      matvec(*part, x, y, scratch, threads);
  } else if (m.type == kF32)
    localmoe_dense::gemv<float>(x, 1, m.cols, static_cast<const float*>(m.data), m.rows, m.bias, y, threads);
  else if (m.type == kBF16)
    localmoe_dense::gemv<uint16_t>(x, 1, m.cols, static_cast<const uint16_t*>(m.data), m.rows, m.bias, y, threads);
  else
    ggml_matrix(m, x, 1, y, scratch, threads);
}

// Tokens per GEMV call of `matrows`: their x (and its int8 copy) stays in L2 while the weight rows stream past
// (a whole prompt chunk in one call read x from memory again for every group of weight rows).
constexpr int64_t kMatrowsSlice = 64;

// Bytes of scratch `matrows` needs for N tokens of up to K values.
inline int64_t matrows_scratch(int64_t N, int64_t K) {
  return localmoe_ggml::scratch_bytes(N < kMatrowsSlice ? N : kMatrowsSlice, K);
}

// y [N, rows] = x [N, cols] W^T (+ b): every weight block read once for each slice of up to kMatrowsSlice
// tokens, each token's bits those `matvec` gives it alone (the dense and GGUF-block GEMVs compute every token on
// its own, whatever the others). A stacked matrix's parts: one_rounding ones read x rounded once a slice
// (stacked_rows); others run one at a time into `parts` ([N, rows] floats), each copied into its columns of y, or
// without `parts` one token at a time.
inline void matrows(const Matrix& m, const float* x, int64_t N, float* y, void* scratch, int threads,
                    float* parts = nullptr) {
  if (m.type == kStacked && one_rounding(m)) {
    stacked_rows(m, x, N, y, scratch, threads, kMatrowsSlice);
    return;
  }
  if (m.type == kStacked && N > 1 && parts != nullptr) {
    int64_t at = 0;
    for (const Matrix* part = static_cast<const Matrix*>(m.data); part->rows > 0; at += part->rows, ++part) {
      matrows(*part, x, N, parts, scratch, threads);
      for (int64_t t = 0; t < N; ++t)
        for (int64_t r = 0; r < part->rows; ++r) y[t * m.rows + at + r] = parts[t * part->rows + r];
    }
    return;
  }
  if (N == 1 || m.type == kStacked) {
    for (int64_t t = 0; t < N; ++t) matvec(m, x + t * m.cols, y + t * m.rows, scratch, threads);
    return;
  }
  for (int64_t t = 0; t < N; t += kMatrowsSlice) {
    const int64_t n = N - t < kMatrowsSlice ? N - t : kMatrowsSlice;
    const float* xs = x + t * m.cols;
    float* ys = y + t * m.rows;
    if (m.type == kF32)
      localmoe_dense::gemv<float>(xs, n, m.cols, static_cast<const float*>(m.data), m.rows, m.bias, ys, threads);
    else if (m.type == kBF16)
      localmoe_dense::gemv<uint16_t>(xs, n, m.cols, static_cast<const uint16_t*>(m.data), m.rows, m.bias, ys,
                                     threads);
    else
      ggml_matrix(m, xs, n, ys, scratch, threads);
  }
}

}  // namespace localmoe
