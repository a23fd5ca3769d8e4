// A qwen3_moe small Q4_K_M decode token's weight stream, read by the row kernels and by a plain read of the same
// bytes in the same order, on 2 MiB or 4 KiB pages (docs/performance.md "MoE GGUFs ... session 12"): 29 fixed
// 512 x 1024 Q4_K_R8 matrices (the attention's 8.6 MB), 72 drawn from a pool of 288 (the routed experts' 21 MB of
// 85 MB), then the 32768 x 1024 Q6_K_R8 lm_head (27.5 MB). Prints each part's min-free mean CPU time, its GB/s
// and plain / kernel (1.0: the kernel reads as fast as a plain read of its bytes). A standalone harness, as
// ggml_q4k_repack.cpp. Build and run from the repository root:
//   g++ -O3 -mavx2 -mfma -mf16c -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -Ikernels -Ikernels/_cpu \
//       benchmarks/ggml_token_stream.cpp -o token_stream
//   ./token_stream tokens [4k]    (4k: ordinary pages, no MADV_HUGEPAGE)
#include <sys/mman.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <utility>
#include <vector>
#include "ggml_gemv/ggml_rows.h"
using namespace localmoe_ggml;
static double cpu() { timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static uint8_t* pages(int64_t n, bool huge) {
  const int64_t h = 2 << 20;
  n = (n + h - 1) / h * h;
  void* p = mmap(nullptr, n + h, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  uint8_t* a = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(p) + h - 1) & ~uintptr_t(h - 1));
  if (huge) madvise(a, n, MADV_HUGEPAGE);  // before the first touch
  return a;
}
__attribute__((noinline)) int64_t plain(const uint8_t* p, int64_t n) {
  __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
  for (int64_t i = 0; i < n; i += 256) {
    s0 = _mm512_add_epi32(s0, _mm512_loadu_si512(p + i));
    s1 = _mm512_add_epi32(s1, _mm512_loadu_si512(p + i + 64));
    s2 = _mm512_add_epi32(s2, _mm512_loadu_si512(p + i + 128));
    s3 = _mm512_add_epi32(s3, _mm512_loadu_si512(p + i + 192));
  }
  return _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(s0, s1), _mm512_add_epi32(s2, s3)));
}
int main(int argc, char** argv) {
  const int tokens = argc > 1 ? atoi(argv[1]) : 20;
  const bool huge = !(argc > 2 && std::strcmp(argv[2], "4k") == 0);
  const int64_t O = 32768, K = 1024, mO = 512, mbytes = mO * K / 256 * 144, hbytes = O * K / 256 * 210;
  const int nf = 29, np = 288, nk = 72;
  uint8_t *F = pages(nf * mbytes, huge), *P = pages(np * mbytes, huge), *H = pages(hbytes, huge);
  std::mt19937 g(1);
  for (auto [a, n] : {std::pair{F, nf * mbytes}, std::pair{P, np * mbytes}, std::pair{H, hbytes}})
    for (int64_t i = 0; i < n; ++i) a[i] = g() & 0x7F;  // fp16 scales below 2: no inf
  std::vector<float> x(K), y(O);
  for (auto& v : x) v = (g() % 2001) / 1000.0f - 1.0f;
  alignas(64) static uint8_t scratch[1 << 16];
  const XQ xq = round_x(x.data(), 1, K, true, scratch);
  const std::vector<BlockXK> xk(xq.kblocks, xq.kblocks + K / 256);
  const BlockXK* xs[1] = {xk.data()};
  double t[2][2] = {{0, 0}, {0, 0}};  // [kernel, plain][attention + experts, head]
  int64_t sink = 0;
  std::vector<int> picks(nk);
  for (int r = 0; r <= tokens; ++r)
    for (int mode = 0; mode < 2; ++mode) {
      for (auto& p : picks) p = g() % np;
      const double t0 = cpu();
      for (int i = 0; i < nf + nk; ++i) {
        const uint8_t* m = i < nf ? F + i * mbytes : P + picks[i - nf] * mbytes;
        if (mode) sink += plain(m, mbytes);
        else for (int64_t gr = 0; gr < mO / 8; ++gr) group8_r8_one(m + gr * 8 * 4 * 144, 0, K / 256, xk.data(), y.data() + 8 * gr, nullptr);
      }
      const double t1 = cpu();
      if (mode) sink += plain(H, hbytes);
      else for (int64_t gr = 0; gr < O / 8; ++gr) group8_q6r8<1>(H + gr * 8 * 4 * 210, 0, K / 256, xs, y.data() + 8 * gr, 0, nullptr);
      const double t2 = cpu();
      if (r > 0) { t[mode][0] += t1 - t0; t[mode][1] += t2 - t1; }  // token 0 warms up
    }
  const double rest = (nf + nk) * mbytes / 1e9, head = hbytes / 1e9;
  printf("%s pages, %d tokens: attention + experts %.1f MB: kernel %.3f ms (%.1f GB/s), plain %.3f ms (%.1f GB/s), "
         "plain / kernel %.2f; head %.1f MB: kernel %.3f ms (%.1f GB/s), plain %.3f ms (%.1f GB/s), plain / kernel %.2f%s\n",
         huge ? "2 MiB" : "4 KiB", tokens, rest * 1e3, t[0][0] / tokens * 1e3, rest * tokens / t[0][0],
         t[1][0] / tokens * 1e3, rest * tokens / t[1][0], t[1][0] / t[0][0], head * 1e3, t[0][1] / tokens * 1e3,
         head * tokens / t[0][1], t[1][1] / tokens * 1e3, head * tokens / t[1][1], t[1][1] / t[0][1], sink == 1 ? " " : "");
}
