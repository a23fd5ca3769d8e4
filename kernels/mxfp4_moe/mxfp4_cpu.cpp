// MXFP4 expert matmul on the CPU (AVX2 + FMA), straight from the canonical bytes.
// Plain C ABI, no torch headers: it builds in about a second with gcc and is loaded with ctypes
// (kernels/mxfp4_moe/cpu.py; ctypes releases the GIL for the call).
//
// y[N, O] = x[N, K] W^T, W given as packed U8 [O, K/2] (element 2i in the low nibble of byte i)
// and E8M0 scales U8 [O, K/32] (bias 127, 0xFF = NaN).
//
// gemv, one token (decode): x is split once per call, per 32-element block, into two int16
// parts on a grid of step amax / 32767: x = step * (hi + lo / 2^16), within ~2^-32 of the block's
// largest magnitude (as accurate as fp32 x itself). A pair of weight blocks (32 code bytes) is
// decoded with two pshufb lookups of 2 * e2m1 as int8, sign-extended to int16 by unpacking
// against its sign mask, and multiplied with both parts by vpmaddwd: the integer dots are exact
// and convert to fp32 exactly (< 2^24), then hi + lo / 2^16 and one FMA per block pair by
// scale(w) * scale(x). Converting every weight to fp32 cost ~13 cycles per block and capped a
// core at ~4.5 GB/s; this runs at ~8-12 GB/s per core, at memory speed with two. (hi alone ran
// at ~14 GB/s per core, but its 2^-16 error made prefill and decode of the tiny models differ by
// 6e-5 in the logits, against 1e-7 before.)
// gemv, N >= 2 tokens: per token the integer path costs ~19 operations per block pair against
// 8 FMAs once the block is in fp32, so each block is decoded to fp32 once and shared by up to 8
// tokens. Both paths are computed whole per row, so the bits do not depend on the thread count.
// dequantize: the same decode to exact fp32, for the prefill path (dequantise + sgemm).
//
// Threads: a small persistent pool (no OpenMP: libgomp's long spin-waiting made 2 threads 6x
// slower than 1 on a shared machine). The caller and the workers take chunks of rows from an
// atomic counter, so a core busy with another process just takes fewer chunks; idle workers
// spin ~50 us, then sleep on a condition variable.
#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPairQ = 128;  // int16 activations per block pair: 64 high parts, then 64 low parts
constexpr int64_t kPairS = 8;   // fp32 activation scales per block pair: [s(b) x4, s(b+1) x4]

struct Tables {
  float half_scale[256];  // scale byte b -> 2^(b - 127) / 2 (the code LUT holds twice the value); 0xFF -> NaN
  Tables() {
    for (int b = 0; b < 255; ++b) half_scale[b] = std::ldexp(1.0f, b - 128);
    half_scale[255] = std::nanf("");
  }
};
const Tables kTables;

// 2 * e2m1(code), exact in int8; bit 3 is the sign (code 8 = -0 decodes as +0).
inline __m128i code_lut() { return _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12); }

inline __m256 widen(__m128i v, __m256 s) { return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), s); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Position of element e (0..31) of block h (0, 1) of a pair in the int16 activation layout. The
// decoded pair (lanes = blocks) unpacks to [even 0-14 | even 16-30 | odd 1-15 | odd 17-31], each
// 16 int16 holding block h's 8 values at h * 8. The low parts follow at +64.
inline int pair_slot(int h, int e) { return ((e & 1) * 2 + (e >> 4)) * 16 + h * 8 + ((e & 15) >> 1); }

// One token: x [K] fp32 -> xq [npairs, 128] int16, xs [npairs, 8] fp32 (a missing odd last block is 0).
// With step = amax / 32767: x = step * (hi + lo / 65536) + err, |err| <= step * 2^-17 (plus fp32
// rounding of the residual), i.e. ~2^-32 of the block's largest magnitude: finer than fp32 itself.
// A block holding NaN or Inf gets scale NaN.
void quantize_row(const float* x, int64_t nb, int16_t* xq, float* xs) {
  const int64_t npairs = (nb + 1) / 2;
  std::memset(xq, 0, npairs * kPairQ * sizeof(int16_t));
  std::memset(xs, 0, npairs * kPairS * sizeof(float));
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  alignas(32) int32_t q[kBlock], r[kBlock];
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4], amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], abs_mask));
      bad = _mm256_or_ps(bad, _mm256_mul_ps(v[j], _mm256_setzero_ps()));  // NaN where x is NaN or Inf
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float top = _mm_cvtss_f32(m);
    const bool finite = _mm256_movemask_ps(_mm256_cmp_ps(bad, bad, _CMP_UNORD_Q)) == 0;
    int16_t* qp = xq + (b / 2) * kPairQ;
    float* sp = xs + (b / 2) * kPairS + (b & 1) * 4;
    const float scale = finite ? top / 32767.0f : std::nanf("");
    for (int j = 0; j < 4; ++j) sp[j] = scale;
    if (!finite || top == 0.0f) continue;
    const __m256 step = _mm256_set1_ps(scale), inv = _mm256_set1_ps(32767.0f / top);
    const __m256 inv_lo = _mm256_mul_ps(inv, _mm256_set1_ps(65536.0f));
    const __m256 lim = _mm256_set1_ps(32767.0f), neg_lim = _mm256_set1_ps(-32767.0f);
    for (int j = 0; j < 4; ++j) {
      const __m256 hi = _mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256 res = _mm256_fnmadd_ps(hi, step, v[j]);  // x - hi * step, one rounding
      const __m256 lo = _mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(res, inv_lo), lim), neg_lim);
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8 * j), _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(hi, lim), neg_lim)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(r + 8 * j), _mm256_cvtps_epi32(lo));
    }
    for (int e = 0; e < kBlock; ++e) {
      qp[pair_slot(b & 1, e)] = static_cast<int16_t>(q[e]);
      qp[64 + pair_slot(b & 1, e)] = static_cast<int16_t>(r[e]);
    }
  }
}

// Decoded pair of blocks (lane h = block h) as four int16 vectors in the pair_slot order.
struct Pair {
  __m256i w[4];
  __m256 ws;  // [half_scale(b) x4, half_scale(b+1) x4]
};

inline Pair decode_pair(__m256i q, float s0, float s1) {
  const __m256i lut = _mm256_broadcastsi128_si256(code_lut()), mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(q, mask));                      // even elements
  const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(q, 4), mask));  // odd elements
  const __m256i slo = _mm256_cmpgt_epi8(_mm256_setzero_si256(), lo);
  const __m256i shi = _mm256_cmpgt_epi8(_mm256_setzero_si256(), hi);
  Pair p;
  p.w[0] = _mm256_unpacklo_epi8(lo, slo);
  p.w[1] = _mm256_unpackhi_epi8(lo, slo);
  p.w[2] = _mm256_unpacklo_epi8(hi, shi);
  p.w[3] = _mm256_unpackhi_epi8(hi, shi);
  p.ws = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
  return p;
}

// Integer dot of the pair with 64 int16 activations: per lane |sum| <= 8 * 12 * 32767 < 2^24.
inline __m256i dot64(const Pair& p, const __m256i* xv) {
  const __m256i d0 = _mm256_add_epi32(_mm256_madd_epi16(p.w[0], _mm256_loadu_si256(xv)),
                                      _mm256_madd_epi16(p.w[1], _mm256_loadu_si256(xv + 1)));
  const __m256i d1 = _mm256_add_epi32(_mm256_madd_epi16(p.w[2], _mm256_loadu_si256(xv + 2)),
                                      _mm256_madd_epi16(p.w[3], _mm256_loadu_si256(xv + 3)));
  return _mm256_add_epi32(d0, d1);
}

inline __m256 pair_dot(const Pair& p, const int16_t* xq, const float* xs, __m256 acc) {
  const __m256i* xv = reinterpret_cast<const __m256i*>(xq);
  // Both integer dots convert exactly; hi + lo / 65536 rounds once.
  const __m256 d = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot64(p, xv + 4)), _mm256_set1_ps(1.0f / 65536),
                                   _mm256_cvtepi32_ps(dot64(p, xv)));
  return _mm256_fmadd_ps(d, _mm256_mul_ps(p.ws, _mm256_loadu_ps(xs)), acc);
}

// One token against one weight row (the N = 1 path).
inline float row_int16(const uint8_t* prow, const uint8_t* srow, int64_t nb, const int16_t* xq, const float* xs) {
  const float* hs = kTables.half_scale;
  __m256 acc = _mm256_setzero_ps();
  int64_t p = 0;
  for (; 2 * p + 2 <= nb; ++p) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(prow + p * 32));
    acc = pair_dot(decode_pair(q, hs[srow[2 * p]], hs[srow[2 * p + 1]]), xq + p * kPairQ, xs + p * kPairS, acc);
  }
  if (2 * p < nb) {  // odd last block: the other lane decodes zeros with scale 0
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(prow + p * 32));
    acc = pair_dot(decode_pair(_mm256_zextsi128_si256(q), hs[srow[2 * p]], 0.0f), xq + p * kPairQ, xs + p * kPairS, acc);
  }
  return hsum(acc);
}

// NT tokens of fp32 x (permuted per block to [x0, x2, .., x30, x1, x3, .., x31], row stride K)
// against one weight row, the N >= 2 path: each block is decoded to fp32 once and shared by the
// tokens' FMAs (8 per block pair and token, against ~19 integer operations for the path above).
// NT <= 2: each block's unscaled dot first, then one FMA by its scale. Writes y[t * O].
template <int NT>
inline void row_f32(const uint8_t* prow, const uint8_t* srow, int64_t nb, const float* xp, int64_t K, float* y,
                    int64_t O) {
  const __m128i lut = code_lut(), mask = _mm_set1_epi8(0x0F);
  constexpr bool kDotFirst = NT <= 2;
  constexpr int NA = kDotFirst ? 2 : (NT <= 4 ? 2 : 1);
  __m256 acc[NT][NA];
  for (int t = 0; t < NT; ++t)
    for (int a = 0; a < NA; ++a) acc[t][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(prow + b * 16));
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(q, mask));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(q, 4), mask));
    const __m256 s = _mm256_set1_ps(kTables.half_scale[srow[b]]);
    const __m256 one = kDotFirst ? _mm256_set1_ps(1.0f) : s;
    const __m256 w[4] = {widen(lo, one), widen(_mm_srli_si128(lo, 8), one), widen(hi, one),
                         widen(_mm_srli_si128(hi, 8), one)};
    for (int t = 0; t < NT; ++t) {
      const float* xb = xp + t * K + b * kBlock;
      if (kDotFirst) {
        const __m256 d0 = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), _mm256_mul_ps(w[0], _mm256_loadu_ps(xb)));
        const __m256 d1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), _mm256_mul_ps(w[2], _mm256_loadu_ps(xb + 16)));
        acc[t][b & 1] = _mm256_fmadd_ps(_mm256_add_ps(d0, d1), s, acc[t][b & 1]);
      } else {
        for (int j = 0; j < 4; ++j) acc[t][j % NA] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + 8 * j), acc[t][j % NA]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    __m256 sum = acc[t][0];
    for (int a = 1; a < NA; ++a) sum = _mm256_add_ps(sum, acc[t][a]);
    y[t * O] = hsum(sum);
  }
}

// ---- thread pool: chunks of [0, total) taken from an atomic counter by the caller and workers ----

struct Job {
  void (*fn)(const void* ctx, int64_t begin, int64_t end);
  const void* ctx;
  int64_t total, chunk, nchunks;
};

class Pool {
 public:
  // Runs job over `threads` threads (the caller included); returns when every chunk is done.
  void run(const Job& job, int threads) {
    const int helpers = static_cast<int>(std::min<int64_t>(threads - 1, job.nchunks - 1));
    if (helpers <= 0) {
      job.fn(job.ctx, 0, job.total);
      return;
    }
    std::lock_guard<std::mutex> serial(call_mu_);  // one job at a time (other callers queue)
    for (; workers_ < helpers; ++workers_) std::thread([this, id = workers_] { loop(id); }).detach();
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = job;
      next_.store(0, std::memory_order_relaxed);
      open_ = true;
      wanted_ = helpers;
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    work();
    {
      std::lock_guard<std::mutex> lk(mu_);
      open_ = false;  // no worker joins after this; those inside finish their chunk
    }
    for (int spin = 0; active_.load(std::memory_order_acquire) != 0; ++spin) {
      if (spin < 1 << 14) _mm_pause();
      else std::this_thread::yield();
    }
  }

  const pid_t pid = getpid();

 private:
  void work() {
    for (int64_t c; (c = next_.fetch_add(1, std::memory_order_relaxed)) < job_.nchunks;)
      job_.fn(job_.ctx, c * job_.chunk, std::min(job_.total, (c + 1) * job_.chunk));
  }

  void loop(int id) {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      // Spin ~50 us for the next call (decode calls come every few tens of us), then sleep.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
      for (int spin = 1; generation_.load(std::memory_order_acquire) == seen; ++spin) {
        _mm_pause();
        if (spin % 64 == 0 && std::chrono::steady_clock::now() > until) break;
      }
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
      seen = generation_.load(std::memory_order_relaxed);
      if (!open_ || id >= wanted_) continue;
      active_.fetch_add(1, std::memory_order_acq_rel);
      lk.unlock();
      work();
      active_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  int workers_ = 0;  // detached threads, never joined: the pool lives as long as the process
  std::mutex call_mu_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int> active_{0};
  Job job_{};
  bool open_ = false;
  int wanted_ = 0;
};

Pool& pool() {
  // Never destroyed (detached workers use it until exit); a forked child, which inherits the
  // object but not the threads, gets a fresh one.
  static std::atomic<Pool*> current{nullptr};
  Pool* p = current.load(std::memory_order_acquire);
  if (p == nullptr || p->pid != getpid()) {
    static std::mutex mu;
    std::lock_guard<std::mutex> lk(mu);
    p = current.load(std::memory_order_relaxed);
    if (p == nullptr || p->pid != getpid()) current.store(p = new Pool(), std::memory_order_release);
  }
  return *p;
}

void parallel(void (*fn)(const void*, int64_t, int64_t), const void* ctx, int64_t total, int64_t chunk,
              int threads) {
  chunk = std::max<int64_t>(chunk, 1);
  pool().run(Job{fn, ctx, total, chunk, (total + chunk - 1) / chunk}, threads);
}

struct GemvArgs {
  const float* x;  // N = 1: unused; N >= 2: x permuted per block
  const int16_t* xq;  // N = 1: the token split into int16 parts
  const float* xs;
  int64_t N, K, O;
  const uint8_t* packed;
  const uint8_t* scales;
  float* y;
};

void gemv_rows(const void* ctx, int64_t o0, int64_t o1) {
  const GemvArgs& a = *static_cast<const GemvArgs*>(ctx);
  const int64_t nb = a.K / kBlock, K = a.K, O = a.O;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* prow = a.packed + o * (K / 2);
    const uint8_t* srow = a.scales + o * nb;
    if (a.N == 1) {
      a.y[o] = row_int16(prow, srow, nb, a.xq, a.xs);
      continue;
    }
    int64_t t = 0;
    for (; t + 8 <= a.N; t += 8) row_f32<8>(prow, srow, nb, a.x + t * K, K, a.y + t * O + o, O);
    if (a.N - t >= 4) {
      row_f32<4>(prow, srow, nb, a.x + t * K, K, a.y + t * O + o, O);
      t += 4;
    }
    if (a.N - t >= 2) {
      row_f32<2>(prow, srow, nb, a.x + t * K, K, a.y + t * O + o, O);
      t += 2;
    }
    if (a.N - t >= 1) row_f32<1>(prow, srow, nb, a.x + t * K, K, a.y + t * O + o, O);
  }
}

struct DequantArgs {
  const uint8_t* packed;
  const uint8_t* scales;
  float* w;
};

void dequantize_blocks(const void* ctx, int64_t b0, int64_t b1) {
  const DequantArgs& a = *static_cast<const DequantArgs*>(ctx);
  const __m128i lut = code_lut(), mask = _mm_set1_epi8(0x0F);
  for (int64_t b = b0; b < b1; ++b) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.packed + b * 16));
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(q, mask));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(q, 4), mask));
    const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);  // elements 0..15, 16..31
    const __m256 s = _mm256_set1_ps(kTables.half_scale[a.scales[b]]);
    float* dst = a.w + b * kBlock;
    _mm256_storeu_ps(dst, widen(first, s));
    _mm256_storeu_ps(dst + 8, widen(_mm_srli_si128(first, 8), s));
    _mm256_storeu_ps(dst + 16, widen(second, s));
    _mm256_storeu_ps(dst + 24, widen(_mm_srli_si128(second, 8), s));
  }
}

constexpr int64_t kChunkBytes = 64 << 10;  // weight bytes per chunk of work (a few microseconds)

}  // namespace

extern "C" {

// Bytes of scratch mxfp4_gemv needs for N tokens of K.
int64_t mxfp4_gemv_scratch(int64_t N, int64_t K) {
  const int64_t npairs = (K / kBlock + 1) / 2;
  return N == 1 ? npairs * (kPairQ * sizeof(int16_t) + kPairS * sizeof(float)) : N * K * sizeof(float);
}

// y [N, O] fp32 = x [N, K] fp32 W^T; packed [O, K/2], scales [O, K/32]; K % 32 == 0; `scratch`
// holds mxfp4_gemv_scratch(N, K) bytes. Rows are split over `threads` threads.
void mxfp4_gemv(const float* x, int64_t N, int64_t K, const uint8_t* packed, const uint8_t* scales, int64_t O,
                float* y, void* scratch, int threads) {
  const int64_t nb = K / kBlock;
  GemvArgs args{nullptr, nullptr, nullptr, N, K, O, packed, scales, y};
  if (N == 1) {
    int16_t* xq = static_cast<int16_t*>(scratch);
    float* xs = reinterpret_cast<float*>(xq + (nb + 1) / 2 * kPairQ);
    quantize_row(x, nb, xq, xs);
    args.xq = xq;
    args.xs = xs;
  } else {
    float* xp = static_cast<float*>(scratch);
    for (int64_t i = 0; i < N * K; i += kBlock)
      for (int j = 0; j < 16; ++j) {
        xp[i + j] = x[i + 2 * j];
        xp[i + 16 + j] = x[i + 2 * j + 1];
      }
    args.x = xp;
  }
  parallel(gemv_rows, &args, O, kChunkBytes / (K / 2 + nb), threads);
}

// packed [nblocks, 16], scales [nblocks] -> w [nblocks, 32] fp32, exact (-0 as +0), on `threads` threads.
void mxfp4_dequantize(const uint8_t* packed, const uint8_t* scales, int64_t nblocks, float* w, int threads) {
  const DequantArgs args{packed, scales, w};
  parallel(dequantize_blocks, &args, nblocks, kChunkBytes / 17, threads);
}

}  // extern "C"
