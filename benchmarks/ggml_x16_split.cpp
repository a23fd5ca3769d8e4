// The x16 lm_head (Q8_0 rows against int16-rounded x, ggml_rows.h) on AVX-512 VNNI: sixteen tokens as one tile
// (group16_x16_split: x split into bytes, q = 256 h + l, vpdpbusd on the rows' int8 codes, so a 16-token tile's sums
// fit in registers and a block's codes are joined once for all of them) against the same tokens as two tiles of
// eight (group16_x16: int16 pairs, vpdpwssd), through the library's own `gemv`: the same bits (checked), and the min
// CPU time per call, one core (docs/performance.md "The 16-row step, session 13").
// Build and run from the repository root:
//   g++ -O3 -mavx2 -mfma -mf16c -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -Ikernels -Ikernels/_cpu \
//       -Ikernels/ggml_gemv benchmarks/ggml_x16_split.cpp -o x16_split
//   ./x16_split [O 49152] [K 576]    (the embedded model's head)
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <vector>
#include "ggml_rows.h"
using namespace localmoe_ggml;
static double cpu() { timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char** argv) {
  const int64_t O = argc > 1 ? atol(argv[1]) : 49152, K = argc > 2 ? atol(argv[2]) : 576, nb = K / 32, N = 16;
  std::mt19937 g(1);
  std::uniform_int_distribution<int> u(0, 255);
  std::vector<uint8_t> w(O * nb * 34);
  for (int64_t r = 0; r < O; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* blk = &w[(r * nb + b) * 34];
      const uint16_t h = _cvtss_sh(0.001f + 0.0001f * (r % 7), 0);
      std::memcpy(blk, &h, 2);
      for (int j = 0; j < 32; ++j) blk[2 + j] = u(g);
    }
  std::normal_distribution<float> n(0, 1);
  std::vector<float> x(N * K);
  for (int64_t i = 0; i < N * K; ++i) x[i] = n(g) * (i % 97 == 0 ? 30.0f : 1.0f);
  std::vector<uint8_t> scratch(scratch_bytes(N, K));
  std::vector<float> one(N * O), two(N * O);
  auto tile16 = [&] { gemv(x.data(), N, K, w.data(), kQ8_0, O, nullptr, one.data(), scratch.data(), 1, kXInt16); };
  auto tiles8 = [&] {
    for (int64_t t0 = 0; t0 < N; t0 += 8)
      gemv(x.data() + t0 * K, 8, K, w.data(), kQ8_0, O, nullptr, two.data() + t0 * O, scratch.data(), 1, kXInt16);
  };
  tile16();
  tiles8();
  int64_t diff = 0;
  for (int64_t i = 0; i < N * O; ++i) diff += std::memcmp(&one[i], &two[i], 4) != 0;
  std::printf("bits: %ld of %ld outputs differ\n", static_cast<long>(diff), static_cast<long>(N * O));
  double best16 = 1e9, best8 = 1e9;
  for (int rep = 0; rep < 9; ++rep) {  // alternated
    double t0 = cpu();
    for (int k = 0; k < 10; ++k) tile16();
    best16 = std::min(best16, (cpu() - t0) / 10);
    t0 = cpu();
    for (int k = 0; k < 10; ++k) tiles8();
    best8 = std::min(best8, (cpu() - t0) / 10);
  }
  const double per = 3.6e9 / static_cast<double>(O * nb * N);  // cycles per (row, block, token) at 3.6 GHz
  std::printf("%ld x %ld, 16 tokens: one tile %.3f ms (%.3f cycles), two tiles of 8 %.3f ms (%.3f cycles): %.3fx\n",
              static_cast<long>(O), static_cast<long>(K), best16 * 1e3, best16 * per, best8 * 1e3, best8 * per,
              best16 / best8);
  return diff != 0;
}
