// The batched step's Q4_1 matrices (the embedded model's 30 layers: q;k;v 960 x 576, o 576 x 576, gate;up 3072 x 576,
// down 576 x 1536, repacked to Q4_1_R8, 66 MB) through the library's own `gemv` on one thread, in the step's order so
// the weight rows come from RAM as they do in the step, for 1-16 tokens; against the floors measured in the same run:
// "read" = one core's streaming read of the same bytes (32-byte loads, no arithmetic), "hot" = the same calls over one
// layer's matrices (2.2 MB, from L2 / L3: the arithmetic). The matrices lie once on 2 MiB pages (as the loader places
// them: kernels/_cpu/pages.py) and once on 4 KiB pages. Min and median CPU time of the rounds (the variants
// alternated inside each round); both copies must give the same outputs. Then x's rounding (`quantize`, run by every `gemv` call: 16 tokens
// of 576 and 1536 values) against its form before session 17, which it must equal byte for byte.
// Build and run from the repository root (AVX-512 VNNI; drop the -mavx512* flags for the AVX2 build):
//   g++ -O3 -mavx2 -mfma -mf16c -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -Ikernels -Ikernels/_cpu \
//       -Ikernels/ggml_gemv benchmarks/q41_rows.cpp -o /tmp/q41_rows
//   /tmp/q41_rows [tokens 1,2,3,5,8,16] [rounds 7]
#include <sys/mman.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <vector>

#include "ggml_rows.h"
using namespace localmoe_ggml;

static double cpu() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

struct Mat {
  uint8_t* w;
  int64_t O, K;
};

// An arena of `bytes` on 2 MiB pages (advised before the first touch) or on 4 KiB pages.
static uint8_t* arena(int64_t bytes, bool huge) {
  const int64_t kHuge = 2 << 20, size = (bytes + 2 * kHuge) / kHuge * kHuge;
  auto* p = static_cast<uint8_t*>(mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (p == MAP_FAILED) std::abort();
  p += (kHuge - reinterpret_cast<uintptr_t>(p) % kHuge) % kHuge;
  madvise(p, size - kHuge, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  return p;
}

// ggml_rows.h's quantize before session 17 (each code stored and summed one at a time): the reference for bits and time.
static void quantize_before(const float* x, int64_t nb, BlockX* xq) {
  for (int64_t b = 0; b < nb; ++b) {
    const localmoe::Block32 blk = localmoe::load_block32(x + b * kBlock);
    BlockX& o = xq[b];
    if (!blk.finite || blk.top == 0.0f) {
      o.d = blk.finite ? 0.0f : std::nanf("");
      o.s = o.d;
      std::memset(o.q, 0, kBlock);
      continue;
    }
    const __m256 inv = _mm256_set1_ps(127.0f / blk.top);
    int32_t sum = 0;
    for (int j = 0; j < 4; ++j) {
      alignas(32) int32_t q[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(q), localmoe::round_scaled(blk.v[j], inv));
      for (int i = 0; i < 8; ++i) {
        o.q[8 * j + i] = static_cast<int8_t>(q[i]);
        sum += q[i];
      }
    }
    o.d = blk.top / 127.0f;
    o.s = o.d * static_cast<float>(sum);
  }
}

// x's rounding, now and before, on 16 tokens of 576 and of 1536 values (the step's inputs), and the bytes compared over
// random blocks of every scale with zeros, ties (x / step = k + 0.5), NaN and Inf among them.
static void rounding(std::mt19937& g) {
  std::normal_distribution<float> n(0, 1);
  std::uniform_int_distribution<int> pick(0, 15);
  const int64_t nb = 4096;
  std::vector<float> x(nb * 32);
  for (int64_t b = 0; b < nb; ++b) {
    const float scale = std::ldexp(1.0f, pick(g) * 4 - 30);
    for (int j = 0; j < 32; ++j) x[b * 32 + j] = n(g) * scale;
    const int kind = pick(g);
    if (kind == 0) std::fill(&x[b * 32], &x[b * 32 + 32], 0.0f);
    if (kind == 1) x[b * 32 + pick(g)] = std::nanf("");
    if (kind == 2) x[b * 32 + pick(g)] = -INFINITY;
    if (kind == 3)  // ties: top 127 so the step is 1, and halves
      for (int j = 0; j < 32; ++j) x[b * 32 + j] = j == 0 ? 127.0f : static_cast<float>(pick(g) - 8) + 0.5f;
  }
  std::vector<BlockX> a(nb), c(nb);
  quantize(x.data(), nb, a.data());
  quantize_before(x.data(), nb, c.data());
  int64_t diff = 0;
  for (int64_t b = 0; b < nb; ++b) diff += std::memcmp(&a[b], &c[b], sizeof(BlockX)) != 0;
  std::printf("x rounding: %ld of %ld blocks differ from the form before\n", static_cast<long>(diff),
              static_cast<long>(nb));
  for (const int64_t K : {576, 1536}) {
    double now = 1e9, before = 1e9;
    for (int rep = 0; rep < 15; ++rep) {  // alternated
      double t0 = cpu();
      for (int k = 0; k < 200; ++k)
        for (int t = 0; t < 16; ++t) quantize(x.data() + t * K, K / 32, a.data() + t * (K / 32));
      now = std::min(now, (cpu() - t0) / 200);
      t0 = cpu();
      for (int k = 0; k < 200; ++k)
        for (int t = 0; t < 16; ++t) quantize_before(x.data() + t * K, K / 32, c.data() + t * (K / 32));
      before = std::min(before, (cpu() - t0) / 200);
    }
    std::printf("  16 tokens of %ld: %.2f us, before %.2f us (%.2fx); a 16-row step rounds 30 x (3 x 576 + 1536) "
                "per row\n", static_cast<long>(K), now * 1e6, before * 1e6, now / before);
  }
}

int main(int argc, char** argv) {
  std::vector<int> counts;
  for (const char* s = argc > 1 ? argv[1] : "1,2,3,5,8,16"; *s;) {
    counts.push_back(static_cast<int>(std::strtol(s, const_cast<char**>(&s), 10)));
    if (*s == ',') ++s;
  }
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  const int64_t D = 576, I = 1536, layers = 30, shapes[4][2] = {{960, D}, {D, D}, {2 * I, D}, {D, I}};
  int64_t total = 0;
  for (auto& s : shapes) total += layers * s[0] * (s[1] / 32) * 20;
  uint8_t* const base[2] = {arena(total, true), arena(total, false)};  // the same bytes on 2 MiB and on 4 KiB pages
  std::mt19937 g(1);
  std::uniform_int_distribution<int> u(0, 255);
  std::vector<Mat> mats[2];
  std::vector<uint8_t> tmp(8 * (I / 32) * 20);
  int64_t at = 0;
  for (int64_t l = 0; l < layers; ++l)
    for (auto& s : shapes) {
      const int64_t O = s[0], K = s[1], nb = K / 32;
      uint8_t* w = base[0] + at;
      for (int64_t r = 0; r < O; ++r)
        for (int64_t b = 0; b < nb; ++b) {
          uint8_t* blk = w + (r * nb + b) * 20;
          const uint16_t d = _cvtss_sh(0.002f + 0.0001f * (r % 11), 0), m = _cvtss_sh(-0.01f * (1 + b % 3), 0);
          std::memcpy(blk, &d, 2);
          std::memcpy(blk + 2, &m, 2);
          for (int j = 0; j < 16; ++j) blk[4 + j] = static_cast<uint8_t>(u(g));
        }
      repack_q41(w, w, O, nb, true, tmp.data());
      std::memcpy(base[1] + at, w, O * nb * 20);
      for (int p = 0; p < 2; ++p) mats[p].push_back({base[p] + at, O, K});
      at += O * nb * 20;
    }
  const int maxN = 16;
  std::normal_distribution<float> n(0, 1);
  std::vector<float> x(maxN * I), y(maxN * 2 * I);
  for (auto& v : x) v = n(g);
  std::vector<uint8_t> scratch(scratch_bytes(maxN, I));
  rounding(g);
  std::printf("%.1f MB of Q4_1_R8 in %zu matrices; min (median) CPU ms of %d rounds\n", total / 1e6, mats[0].size(),
              rounds);

  auto step = [&](const std::vector<Mat>& ms, int N, int64_t first) {  // one layer's calls, in the step's order
    uint64_t h = 0;
    for (int64_t i = 0; i < 4; ++i) {
      const Mat& m = ms[first + i];
      gemv(x.data(), N, m.K, m.w, kQ4_1_R8, m.O, nullptr, y.data(), scratch.data(), 1);
      for (int64_t j = 0; j < N * m.O; j += 61) {
        uint32_t v;
        std::memcpy(&v, &y[j], 4);
        h = h * 1000003 + v;
      }
    }
    return h;
  };
  auto cold = [&](int p, int N) {
    uint64_t h = 0;
    for (int64_t l = 0; l < layers; ++l) h = h * 31 + step(mats[p], N, 4 * l);
    return h;
  };
  auto hot = [&](int N) {
    uint64_t h = 0;
    for (int64_t l = 0; l < layers; ++l) h = h * 31 + step(mats[0], N, 0);
    return h;
  };
  auto read = [&](int p) {  // 32-byte loads, so that the AVX2 build runs it too
    const auto at = [&](int64_t i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base[p] + i)); };
    __m256i acc = _mm256_setzero_si256();
    for (int64_t i = 0; i + 128 <= total; i += 128)
      acc = _mm256_xor_si256(acc, _mm256_or_si256(_mm256_or_si256(at(i), at(i + 32)), _mm256_or_si256(at(i + 64),
                                                                                                      at(i + 96))));
    return static_cast<uint64_t>(_mm256_extract_epi64(acc, 0) | _mm256_extract_epi64(acc, 3));
  };
  auto stat = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return std::make_pair(v[0] * 1e3, v[v.size() / 2] * 1e3);
  };
  for (int N : counts) {
    std::vector<double> t[5];  // cold 2 MiB, cold 4 KiB, hot, read 2 MiB, read 4 KiB: alternated
    uint64_t h[3] = {0, 0, 0}, sink = 0;
    for (int r = 0; r < rounds; ++r) {
      const double t0 = cpu();
      h[0] = cold(0, N);
      const double t1 = cpu();
      h[1] = cold(1, N);
      const double t2 = cpu();
      h[2] = hot(N);
      const double t3 = cpu();
      sink ^= read(0);
      const double t4 = cpu();
      sink ^= read(1);
      const double t5 = cpu();
      for (int k = 0; k < 5; ++k) t[k].push_back((k == 0 ? t1 - t0 : k == 1 ? t2 - t1 : k == 2 ? t3 - t2 : k == 3 ? t4 - t3
                                                                                                             : t5 - t4));
    }
    std::pair<double, double> s[5];
    for (int k = 0; k < 5; ++k) s[k] = stat(t[k]);
    std::printf("%2d tokens: 2 MiB %.3f (%.3f), 4 KiB %.3f (%.3f) = %.2fx; hot %.3f (%.3f); read 2 MiB %.3f (%.3f) "
                "%.1f GB/s, 4 KiB %.3f (%.3f) %.1f GB/s; 2 MiB - max(hot, read) %.3f ms; %s\n",
                N, s[0].first, s[0].second, s[1].first, s[1].second, s[1].first / s[0].first, s[2].first, s[2].second,
                s[3].first, s[3].second, total / s[3].first / 1e6, s[4].first, s[4].second, total / s[4].first / 1e6,
                s[0].first - std::max(s[2].first, s[3].first), h[0] == h[1] ? "same outputs" : "OUTPUTS DIFFER");
    if (sink == 42) std::puts("");
  }
    return 0;
}
