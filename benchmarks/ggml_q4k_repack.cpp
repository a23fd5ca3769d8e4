// Q4_K rows in the GGUF layout against Q4_K_R8 (the load-time repack, ggml_rows8_k.h) through the library's own `gemv`:
// the same bits (checked on every call shape) and the time per call. A standalone harness (docs/performance.md "MoE
// GGUFs ... session 10"). Build and run from the repository root:
//   g++ -O3 -mavx2 -mfma -mf16c -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -Ikernels -Ikernels/_cpu \
//       benchmarks/ggml_q4k_repack.cpp -o q4k_repack    (AVX2 build: drop the -mavx512* flags)
//   ./q4k_repack O K N reps copies    (N tokens; copies > 1 cycles that many matrices so that they come from memory;
//                                      prints the min per call of each layout, CPU time, and whether the bits agree)
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <vector>

#include "ggml_gemv/ggml_rows.h"
using namespace localmoe_ggml;

static double cpu() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char** argv) {
  if (argc < 6) return 1;
  const int64_t O = atoll(argv[1]), K = atoll(argv[2]), N = atoll(argv[3]);
  const int reps = atoi(argv[4]), copies = atoi(argv[5]);
  const int64_t nsb = K / 256, rb = nsb * 144, bytes = rb * O;
  std::mt19937 g(1);
  std::vector<uint8_t> w(bytes * copies), wr(bytes * copies), back(bytes), tmp(8 * rb);
  for (auto& b : w) b = g() & 0xFF;
  for (int64_t i = 0; i < O * copies * nsb; ++i)
    for (int h = 0; h < 2; ++h) {
      const uint16_t v = 0x2000 | (g() & 0x3FF);
      std::memcpy(w.data() + i * 144 + 2 * h, &v, 2);
    }
  for (int c = 0; c < copies; ++c) repack_q4k(w.data() + c * bytes, wr.data() + c * bytes, O, nsb, true, tmp.data());
  std::memcpy(back.data(), wr.data(), bytes);
  repack_q4k(back.data(), back.data(), O, nsb, false, tmp.data());  // in place, back
  const bool round_trip = std::memcmp(back.data(), w.data(), bytes) == 0;
  std::vector<float> x(N * K), y(N * O), y2(N * O);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(g);
  std::vector<char> scratch_buffer(scratch_bytes(N, K) + 64);
  void* scratch = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(scratch_buffer.data()) + 63) & ~uintptr_t{63});
  gemv(x.data(), N, K, w.data(), kQ4_K, O, nullptr, y.data(), scratch, 1);
  gemv(x.data(), N, K, wr.data(), kQ4_K_R8, O, nullptr, y2.data(), scratch, 1);
  const bool same = std::memcmp(y.data(), y2.data(), N * O * 4) == 0;
  double best[2] = {1e9, 1e9};
  for (int r = 0; r < reps; ++r)
    for (int which = 0; which < 2; ++which) {
      const double t0 = cpu();
      for (int c = 0; c < copies; ++c)
        gemv(x.data(), N, K, (which ? wr : w).data() + c * bytes, which ? kQ4_K_R8 : kQ4_K, O, nullptr, y.data(),
             scratch, 1);
      best[which] = std::min(best[which], (cpu() - t0) / copies);
    }
  printf("%ldx%ld N=%ld copies=%d: gguf %.4f ms (%.1f GB/s), r8 %.4f ms (%.1f GB/s), %.2fx, same=%d round_trip=%d\n", O,
         K, N, copies, best[0] * 1e3, bytes / best[0] / 1e9, best[1] * 1e3, bytes / best[1] / 1e9, best[0] / best[1],
         same, round_trip);
  return same && round_trip ? 0 : 2;
}
