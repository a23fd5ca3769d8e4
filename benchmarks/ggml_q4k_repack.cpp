// Q4_K one-token rows from a load-time repack against the GGUF layout (issue 24, session 9; docs/performance.md "MoE GGUFs:
// Q6_K rows eight at a time, logits like for like, a Q4_K repack measured"): a standalone probe, not part of the library.
// Repacked layout per eight rows and super-block (1184 bytes): the rows' fp16 d [8] and dmin [8], their 6-bit scales and
// mins expanded to bytes [8 sub-blocks][8 rows], then the nibble bytes as rows8k transposes them at run time (for each pair
// of sub-blocks and each 4-byte column i: 32 bytes, lane r = row r's bytes 4i..4i+3). The kernel (rows_r8) gives the bits
// of ggml_rows.h's one-token Q4_K rows (checked: same=1). Build and run from the repository root:
//   g++ -O3 -mavx2 -mfma -mf16c -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -Ikernels -Ikernels/_cpu \
//       benchmarks/ggml_q4k_repack.cpp -o /tmp/q4k_repack    (AVX2 build: drop the -mavx512* flags)
//   /tmp/q4k_repack O K reps copies which     (which: 0 the GGUF layout through gemv, 1 repacked; copies > 1 cycles that
//                                              many matrices so that they come from memory; prints the min per call)
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <vector>
#include <random>
#include "ggml_gemv/ggml_rows.h"
using namespace localmoe_ggml;
static double cpu() { timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

// repacked: per 8-row group, per super-block: d[8] fp16, dmin[8] fp16, sc[8][8] u8, mn[8][8] u8, codes[4][8] x 32 bytes
constexpr int64_t kR = 32 + 128 + 1024;
void repack(const uint8_t* w, int64_t O, int64_t nsb, uint8_t* out) {
  for (int64_t g = 0; g < O / 8; ++g)
    for (int64_t u = 0; u < nsb; ++u) {
      uint8_t* o = out + (g * nsb + u) * kR;
      for (int r = 0; r < 8; ++r) {
        const uint8_t* b = w + ((g * 8 + r) * nsb + u) * 144;
        memcpy(o + 2 * r, b, 2); memcpy(o + 16 + 2 * r, b + 2, 2);
        uint64_t sc, mn; q4_k_scales(b + 4, sc, mn);
        for (int j = 0; j < 8; ++j) { o[32 + 8 * j + r] = (sc >> (8 * j)) & 0xFF; o[96 + 8 * j + r] = (mn >> (8 * j)) & 0xFF; }
        for (int p = 0; p < 4; ++p) for (int i = 0; i < 8; ++i) memcpy(o + 160 + (p * 8 + i) * 32 + 4 * r, b + 16 + 32 * p + 4 * i, 4);
      }
    }
}
__attribute__((noinline)) void rows_r8(const uint8_t* wr, int64_t O, int64_t nsb, const BlockXK* x, float* y) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < O / 8; ++g) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t u = 0; u < nsb; ++u) {
      const uint8_t* o = wr + (g * nsb + u) * kR;
      const BlockXK& xb = x[u];
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o));
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o + 16)));
      __m256i isum = _mm256_setzero_si256();
      __m256 mins;
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        __m256i s[2][2] = {{_mm256_setzero_si256(), _mm256_setzero_si256()}, {_mm256_setzero_si256(), _mm256_setzero_si256()}};
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          const __m256i v = _mm256_loadu_si256((const __m256i*)(o + 160 + (p * 8 + i) * 32));
          s[0][i & 1] = dot4_add(s[0][i & 1], _mm256_and_si256(v, low4), codes4(xb.q + 64 * p, i));
          s[1][i & 1] = dot4_add(s[1][i & 1], _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), codes4(xb.q + 64 * p + 32, i));
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const int j = 2 * p + h;
          const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(o + 32 + 8 * j)));
          isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(_mm256_add_epi32(s[h][0], s[h][1]), sc));
        }
      }
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(o + 96 + 8 * j))));
        mins = j == 0 ? _mm256_mul_ps(m, _mm256_broadcast_ss(&xb.sums[0])) : _mm256_fmadd_ps(m, _mm256_broadcast_ss(&xb.sums[j]), mins);
      }
      const __m256 xd = _mm256_broadcast_ss(&xb.d);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, xd), acc);
      acc = _mm256_fnmadd_ps(mins, _mm256_mul_ps(dmin, xd), acc);
    }
    _mm256_storeu_ps(y + 8 * g, acc);
  }
}
int main(int argc, char** argv) {
  int64_t O = atoll(argv[1]), K = atoll(argv[2]); int reps = atoi(argv[3]); int copies = atoi(argv[4]); int which = atoi(argv[5]);
  int64_t nsb = K / 256, rb = nsb * 144;
  std::mt19937 g(1);
  std::vector<uint8_t> w(rb * O * copies);
  for (auto& b : w) b = g() & 0xFF;
  for (int64_t i = 0; i < O * copies * nsb; ++i) { uint16_t h = 0x2000 | (g() & 0x3FF); memcpy(w.data() + i * 144, &h, 2); h = 0x2000 | (g() & 0x3FF); memcpy(w.data() + i * 144 + 2, &h, 2); }
  std::vector<uint8_t> wr(O / 8 * nsb * kR * copies);
  for (int c = 0; c < copies; ++c) repack(w.data() + c * rb * O, O, nsb, wr.data() + c * (O / 8) * nsb * kR);
  std::vector<float> x(K), y(O), y2(O);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(g);
  std::vector<char> scratch(scratch_bytes(1, K) + 64);
  std::vector<BlockXK> xq(nsb); quantize_k(x.data(), nsb, xq.data());
  gemv(x.data(), 1, K, w.data(), kQ4_K, O, nullptr, y.data(), scratch.data(), 1);
  rows_r8(wr.data(), O, nsb, xq.data(), y2.data());
  int same = memcmp(y.data(), y2.data(), O * 4) == 0;
  double best = 1e9;
  for (int r = 0; r < reps; ++r) {
    double t0 = cpu();
    for (int c = 0; c < copies; ++c) {
      if (which == 0) gemv(x.data(), 1, K, w.data() + c * rb * O, kQ4_K, O, nullptr, y.data(), scratch.data(), 1);
      else { quantize_k(x.data(), nsb, xq.data()); rows_r8(wr.data() + c * (O / 8) * nsb * kR, O, nsb, xq.data(), y2.data()); }
    }
    double t = (cpu() - t0) / copies; if (t < best) best = t;
  }
  printf("%s %ldx%ld %.4f ms %.1f GB/s same=%d\n", which ? "r8  " : "gguf", O, K, best * 1e3, rb * O / best / 1e9, same);
}
