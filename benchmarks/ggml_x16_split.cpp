// The x16 lm_head (Q8_0 rows against int16-rounded x, ggml_rows.h `group16_x16`) on 16 rows x 16 tokens with x split
// into bytes for vpdpbusd (q = 256 h + l: sum w q = 256 (sum w (h + 128) - 128 sum w) + sum w l, an exact int32 as
// the int16 pairs' vpdpwssd sum is), so the rows' codes stay int8 (8 zmm) and a 16-token tile fits in registers: the
// block's codes are read and joined once per 16 tokens instead of once per 8. Checks the bits against the library's
// own `gemv` (kXInt16) and times both, one core, min CPU time per call (docs/performance.md "The 16-row step, session
// 13"). AVX-512 VNNI only. Build and run from the repository root:
//   g++ -O3 -mavx2 -mfma -mf16c -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -Ikernels -Ikernels/_cpu \
//       -Ikernels/ggml_gemv benchmarks/ggml_x16_split.cpp -o x16_split
//   ./x16_split [O 6144] [K 576]    (the embedded model's head: 49152 576)
#include <cstdio>
#include <ctime>
#include <random>
#include <vector>
#include "ggml_rows.h"
using namespace localmoe_ggml;
static double cpu() { timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

struct SplitX {          // one (token, block) of x16, bytes for vpdpbusd: q = 256 h + l
  uint32_t l[8];         // dword i: l of x[4i .. 4i + 3] (unsigned bytes)
  uint32_t h[8];         // dword i: h + 128 of x[4i .. 4i + 3]
  float d;
  float pad[15];
};

static void split(const BlockX16* xb, int64_t nb, SplitX* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const int16_t* q = xb[b].q;
    for (int i = 0; i < 8; ++i) {
      const int16_t v[4] = {q[4 * i], q[4 * i + 2], q[4 * i + 1], q[4 * i + 3]};  // x[4i], x[4i+1], x[4i+2], x[4i+3]
      uint32_t l = 0, h = 0;
      for (int k = 0; k < 4; ++k) {
        l |= uint32_t(uint8_t(v[k] & 0xff)) << (8 * k);
        h |= uint32_t(uint8_t((v[k] >> 8) + 128)) << (8 * k);
      }
      out[b].l[i] = l;
      out[b].h[i] = h;
    }
    out[b].d = xb[b].d;
  }
}

template <int TN>
__attribute__((noinline)) void group16_split(const uint8_t* row0, int64_t stride, int64_t nb, const SplitX* const* x,
                                             float* y, int64_t ldy) {
  __m512 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm512_setzero_ps();
  const NextGroup ahead(row0, 16, stride, nb);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t b = 0; b < nb; ++b) {
    ahead.fetch(b);
    const uint8_t* blk = row0 + b * 34;
    __m256i lo[8], hi[8];
    q8_0_codes8(blk, stride, lo);
    q8_0_codes8(blk + 8 * stride, stride, hi);
    __m512i codes[8];
    __m512i sw = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) {
      codes[i] = join8(lo[i], hi[i]);
      sw = _mm512_dpbusd_epi32(sw, ones, codes[i]);
    }
    sw = _mm512_slli_epi32(sw, 7);  // 128 sum(w): what h + 128 adds
    const __m512 d = join8(halves8(gather8(blk, stride), false), halves8(gather8(blk + 8 * stride, stride), false));
#pragma GCC unroll 16
    for (int t = 0; t < TN; ++t) {
      const SplitX& xb = x[t][b];
      __m512i sl = _mm512_setzero_si512(), sh = _mm512_setzero_si512();
      for (int i = 0; i < 8; ++i) {
        sl = _mm512_dpbusd_epi32(sl, _mm512_set1_epi32(xb.l[i]), codes[i]);
        sh = _mm512_dpbusd_epi32(sh, _mm512_set1_epi32(xb.h[i]), codes[i]);
      }
      const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_sub_epi32(sh, sw), 8), sl);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(xb.d)), acc[t]);
    }
  }
  for (int t = 0; t < TN; ++t) _mm512_storeu_ps(y + t * ldy, acc[t]);
}

int main(int argc, char** argv) {
  const int64_t O = argc > 1 ? atol(argv[1]) : 6144, K = argc > 2 ? atol(argv[2]) : 576, nb = K / 32;
  std::mt19937 g(1);
  std::uniform_int_distribution<int> u(0, 255);
  std::vector<uint8_t> w(O * nb * 34);
  for (int64_t r = 0; r < O; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* blk = &w[(r * nb + b) * 34];
      uint16_t h = _cvtss_sh(0.001f + 0.0001f * (r % 7), 0);
      memcpy(blk, &h, 2);
      for (int j = 0; j < 32; ++j) blk[2 + j] = u(g);
    }
  // the library's layout for rows8 (repacked?) is the GGUF Q8_0 layout here: gemv reads rows of nb * 34 bytes
  const int64_t N = 16;
  std::normal_distribution<float> n(0, 1);
  std::vector<float> x(N * K);
  for (int64_t i = 0; i < N * K; ++i) x[i] = n(g) * (i % 97 == 0 ? 30.0f : 1.0f);
  std::vector<uint8_t> scratch(scratch_bytes(N, K));
  std::vector<float> y(N * O), y2(N * O);
  gemv(x.data(), N, K, w.data(), kQ8_0, O, nullptr, y.data(), scratch.data(), 1, kXInt16);
  std::vector<BlockX16> xq(N * nb);
  for (int64_t t = 0; t < N; ++t) quantize16(x.data() + t * K, nb, xq.data() + t * nb);
  std::vector<SplitX> xs(N * nb);
  auto run_split = [&](int nt) {
    for (int64_t t = 0; t < nt; ++t) split(xq.data() + t * nb, nb, xs.data() + t * nb);
    const SplitX* xp[16];
    for (int t = 0; t < 16; ++t) xp[t] = xs.data() + t * nb;
    const int64_t stride = nb * 34;
    for (int64_t r = 0; r < O; r += 16) {
      if (nt == 16) group16_split<16>(w.data() + r * stride, stride, nb, xp, y2.data() + r, O);
      else group16_split<8>(w.data() + r * stride, stride, nb, xp, y2.data() + r, O);
    }
  };
  run_split(16);
  int64_t diff = 0;
  for (int64_t i = 0; i < N * O; ++i) diff += memcmp(&y[i], &y2[i], 4) != 0;
  printf("bits: %ld of %ld differ (y[0] %.9g %.9g)\n", (long)diff, (long)(N * O), y[0], y2[0]);
  for (int rep0 = 0; rep0 < 2; ++rep0) {
    double best = 1e9, best2 = 1e9;
    for (int rep = 0; rep < 9; ++rep) {
      double t0 = cpu();
      for (int k = 0; k < 10; ++k) gemv(x.data(), 16, K, w.data(), kQ8_0, O, nullptr, y.data(), scratch.data(), 1, kXInt16);
      best = std::min(best, (cpu() - t0) / 10);
      t0 = cpu();
      for (int k = 0; k < 10; ++k) run_split(16);
      best2 = std::min(best2, (cpu() - t0) / 10);
    }
    printf("16 tokens %ldx%ld: library %.4f ms (%.3f cycles), split %.4f ms (%.3f cycles): %.3fx\n", (long)O, (long)K,
           best * 1e3, best * 3.6e9 / (O * nb * 16), best2 * 1e3, best2 * 3.6e9 / (O * nb * 16), best2 / best);
  }
}
