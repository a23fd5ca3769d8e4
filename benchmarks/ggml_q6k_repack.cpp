// Q6_K rows in the GGUF layout against Q6_K_R8 (the load-time repack, ggml_rows8_q6k.h) through the library's own `gemv`:
// the same bits (checked per call shape, with and without bias), the repack's round trip, and the min CPU time per call.
// A standalone harness (docs/performance.md "MoE GGUFs: Q6_K repacked at load ... session 11"), as ggml_q4k_repack.cpp.
// Build and run from the repository root:
//   g++ -O3 -mavx2 -mfma -mf16c -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -Ikernels -Ikernels/_cpu \
//       benchmarks/ggml_q6k_repack.cpp -o q6k_repack    (AVX2 build: drop the -mavx512* flags)
//   ./q6k_repack O K N reps copies    (N tokens; copies > 1 cycles that many matrices so that they come from memory)
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <vector>
#include "ggml_gemv/ggml_rows.h"
using namespace localmoe_ggml;
static double cpu() { timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char** argv) {
  const int64_t O = atoll(argv[1]), K = atoll(argv[2]), N = atoll(argv[3]);
  const int reps = atoi(argv[4]), copies = atoi(argv[5]);
  const int64_t nsb = K / 256, rb = nsb * 210, bytes = rb * O;
  std::mt19937 g(1);
  std::vector<uint8_t> w(bytes * copies), wr(bytes * copies), back(bytes), tmp(8 * rb);
  for (auto& b : w) b = g() & 0xFF;
  for (int64_t i = 0; i < O * copies * nsb; ++i) { const uint16_t v = 0x2000 | (g() & 0x3FF); std::memcpy(w.data() + i * 210 + 208, &v, 2); }
  for (int c = 0; c < copies; ++c) repack_q6k(w.data() + c * bytes, wr.data() + c * bytes, O, nsb, true, tmp.data());
  std::memcpy(back.data(), wr.data(), bytes);
  repack_q6k(back.data(), back.data(), O, nsb, false, tmp.data());
  const bool rt = std::memcmp(back.data(), w.data(), bytes) == 0;
  std::vector<float> x(N * K), y(N * O), y2(N * O), bias(O);
  for (auto& v : x) v = (g() % 20001) / 10000.0f - 1.0f;
  for (auto& v : bias) v = (g() % 2001) / 1000.0f - 1.0f;
  std::vector<uint8_t> scratch(scratch_bytes(N, K) + 64);
  bool same = true;
  for (int c = 0; c < copies && c < 3; ++c) for (int b = 0; b < 2; ++b) {
    gemv(x.data(), N, K, w.data() + c * bytes, kQ6_K, O, b ? bias.data() : nullptr, y.data(), scratch.data(), 1);
    gemv(x.data(), N, K, wr.data() + c * bytes, kQ6_K_R8, O, b ? bias.data() : nullptr, y2.data(), scratch.data(), 1);
    same &= std::memcmp(y.data(), y2.data(), 4 * N * O) == 0;
  }
  double best[2] = {1e9, 1e9};
  for (int r = 0; r < reps; ++r)
    for (int l = 0; l < 2; ++l) {
      const int c = r % copies;
      const double t0 = cpu();
      gemv(x.data(), N, K, (l ? wr : w).data() + c * bytes, l ? kQ6_K_R8 : kQ6_K, O, nullptr, y.data(), scratch.data(), 1);
      best[l] = std::min(best[l], cpu() - t0);
    }
  printf("O %ld K %ld N %ld copies %d: plain %.1f us (%.1f GB/s), R8 %.1f us (%.1f GB/s): %.2fx; bits %s, round trip %s\n",
         O, K, N, copies, best[0] * 1e6, bytes / best[0] / 1e9, best[1] * 1e6, bytes / best[1] / 1e9, best[0] / best[1],
         same ? "same" : "DIFFER", rt ? "ok" : "BAD");
}
