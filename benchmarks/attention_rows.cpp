// The batched decode step's attention on the embedded model's shapes (SmolLM2: 30 layers, 3 KV heads of 64, 3 query
// heads each), through the library's own `gqa_decode_paged` (kernels/gqa_decode paged_cpu.cpp, one thread): N rows
// of N sequences, or a verify's N rows on one sequence, each over its own fp32 pools, against the floor of the bytes
// it reads (one core's streaming read of a 512 MB buffer, measured in the same run) and against the same call with
// every layer on one layer's pools (hot in L2 / L3: what the arithmetic alone costs). Prints the min and median CPU
// time of a step (30 calls), its read rate and a hash of the outputs (equal between builds that change no bits;
// docs/performance.md "The batched step's attention and glue, session 16").
// Build and run from the repository root:
//   g++ -O3 -mavx2 -mfma -mf16c -std=c++17 -pthread -mavx512f -mavx512bw -mavx512vl -mavx512vnni -Ikernels/_cpu \
//       benchmarks/attention_rows.cpp -o attention_rows
//   ./attention_rows [N 16] [context 65] [verify 0: N sequences; 1: N rows of one] [steps 20]
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <vector>

#include "../kernels/gqa_decode/paged_cpu.cpp"

static double cpu() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

// One core's read rate (bytes / s): the best of 5 passes summing a 512 MB buffer.
static double read_rate() {
  std::vector<float> buf((size_t)1 << 27, 1.0f);
  double best = 1e9;
  float sink = 0.0f;
  for (int r = 0; r < 5; ++r) {
    const double t0 = cpu();
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (size_t i = 0; i < buf.size(); i += 32)
      for (int u = 0; u < 4; ++u) a[u] = _mm256_add_ps(a[u], _mm256_loadu_ps(&buf[i + 8 * u]));
    best = std::min(best, cpu() - t0);
    sink += localmoe::hsum(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
  }
  if (sink == 0.0f) std::printf("?\n");
  return buf.size() * 4.0 / best;
}

int main(int argc, char** argv) {
  const int N = argc > 1 ? atoi(argv[1]) : 16, ctx = argc > 2 ? atoi(argv[2]) : 65;
  const int verify = argc > 3 ? atoi(argv[3]) : 0, steps = argc > 4 ? atoi(argv[4]) : 20;
  const int L = 30, Hkv = 3, G = 3, H = Hkv * G, D = 64;
  const int64_t block = std::min(256, ctx + 8), nb = (ctx + 8 + block - 1) / block;  // rows_step.py's caches
  const int S = verify ? 1 : N;  // sequences
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<int64_t> table(nb);
  for (int64_t b = 0; b < nb; ++b) table[b] = b;
  std::vector<std::vector<float>> kp(L * S), vp(L * S);  // [Hkv, nb, block, D] per layer and sequence
  for (int i = 0; i < L * S; ++i) {
    kp[i].resize(Hkv * nb * block * D);
    vp[i].resize(kp[i].size());
    for (float& x : kp[i]) x = normal(rng);
    for (float& x : vp[i]) x = normal(rng);
  }
  std::vector<float> q(N * H * D), k(N * Hkv * D), v(N * Hkv * D), out((size_t)L * N * H * D);
  for (float& x : q) x = normal(rng);
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  std::vector<int64_t> seqs(N * 10);
  const auto step = [&](bool hot) {
    for (int l = 0; l < L; ++l) {
      for (int n = 0; n < N; ++n) {
        const int i = (hot ? 0 : l) * S + (verify ? 0 : n);
        int64_t* f = &seqs[n * 10];
        f[0] = (int64_t)kp[i].data(), f[1] = (int64_t)table.data(), f[2] = nb * block * D;
        f[3] = (int64_t)vp[i].data(), f[4] = (int64_t)table.data(), f[5] = nb * block * D;
        f[6] = block, f[7] = nb * block, f[8] = verify ? ctx - N + 1 + n : ctx, f[9] = 0;
      }
      gqa_decode_paged(q.data(), H * D, D, k.data(), Hkv * D, D, v.data(), Hkv * D, D, N, H, G, D, seqs.data(),
                       nullptr, 0.125f, out.data() + (size_t)l * N * H * D, 1);
    }
  };
  double bytes = 0;  // K and V rows read a step (a verify's rows each read theirs)
  for (int n = 0; n < N; ++n) bytes += (double)L * Hkv * ((verify ? ctx - N + 1 + n : ctx) + 1) * D * 2 * 4;
  const double rate = read_rate();
  std::printf("%d %s at context %d: %.1f MB of fp32 K/V read a step; one core reads %.1f GB/s: floor %.2f ms\n", N,
              verify ? "rows of one sequence (a verify)" : "sequences", ctx, bytes / 1e6, rate / 1e9, bytes / rate * 1e3);
  for (const bool hot : {false, true}) {
    std::vector<double> t;
    for (int r = 0; r < steps; ++r) {
      const double t0 = cpu();
      step(hot);
      t.push_back(cpu() - t0);
    }
    std::sort(t.begin(), t.end());
    uint64_t hash = 1469598103934665603ull;
    for (float x : out) {
      uint32_t u;
      std::memcpy(&u, &x, 4);
      hash = (hash ^ u) * 1099511628211ull;
    }
    std::printf("  %s: min %.3f ms, median %.3f ms a step, %.1f GB/s, %.2fx the floor; outputs' hash %016llx\n",
                hot ? "one layer's pools (hot)" : "30 layers' pools      ", t[0] * 1e3, t[t.size() / 2] * 1e3,
                bytes / t[0] / 1e9, t[0] * rate / bytes, (unsigned long long)hash);
  }
}
