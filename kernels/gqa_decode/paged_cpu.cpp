// Decode attention of N sequences in one call, each over its own paged cache (AVX2 + FMA): the
// batched decode step's attention (engine/batch.py), one call per layer instead of a cache write and
// an attention call per sequence.
//
// Row n is one new token of a sequence at cache position pos_n: its k and v rows [Hkv, D] are
// written at pos_n of that sequence's pools, then each of its H query heads attends to keys
// [first_n, pos_n] of its KV head (gqa_cpu.cpp's computation: online softmax, optional sinks).
// A pool is the paged cache's [Hkv, P, block, D] fp32 tensor (engine/cache.py PagedBuffer): head h's
// position s lies in physical block table[s / block], at h * head_stride + (table[s / block] * block +
// s % block) * D. Rows may share a cache (a speculative verify: consecutive positions in row order):
// every row's k/v is written before any attention runs, and row n reads only positions <= pos_n.
// Each (row, KV head) is computed whole by one thread, its query heads together (gqa_heads.h
// `group_heads`: each key and value row read once for them), with the same instructions per head as
// gqa_decode over a contiguous copy of the same keys: a row's bits depend neither on the other rows nor
// on the thread count.
// A row may instead hold a bf16 / fp8 cache in its own dtype (fp8_cache/cache_rows.h, as the fused steps read
// it: its key and value table fields 0, its pool fields the addresses of two `CacheRows`, one sequence's K and
// V): its k/v written as the engine writes them (quantised, and into the exact ring of the newest positions),
// its heads reading the dequantised rows (gqa_heads.h `CachedRows`, the fused steps' reader). The ring holds the
// newest positions only, so rows of one such cache (a verify) run in turns, each row's write and attention
// before the next row's write: every row then reads what it reads alone.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "gqa_heads.h"

namespace {

using localmoe_gqa::CachedRows;
using localmoe_gqa::group_heads;
using localmoe_gqa::kKeys;
using localmoe_cache::CacheRows;

// One row's cache: int64 [kSeqFields] (addresses as integers).
enum Field {
  kKeyPool, kKeyTable, kKeyStride, kValuePool, kValueTable, kValueStride, kBlock, kCapacity, kPos, kFirst, kSeqFields
};

struct PagedRows {
  const float *k, *v;
  const int64_t *kt, *vt;
  int64_t block, D;
  localmoe_gqa::RawRows raw(int64_t, int64_t) const { return {nullptr, nullptr, 0}; }
  // Rows s0 .. s0 + n of pool p through table t, walked block by block.
  void walk(const float* p, const int64_t* t, int64_t s0, int64_t n, const float** r) const {
    int64_t b = s0 / block, at = s0 - b * block;
    const float* row = p + (t[b] * block + at) * D;
    for (int64_t j = 0; j < n; ++j, ++at, row += D) {
      if (at == block) {
        at = 0;
        row = p + t[++b] * block * D;
      }
      r[j] = row;
    }
  }
  void keys(int64_t s0, int64_t n, const uint8_t* vis, const float** kr) const {
    walk(k, kt, s0, n, kr);
    for (int64_t j = 0; vis && j < n; ++j)
      if (!vis[j]) kr[j] = nullptr;
  }
  void values(int64_t s0, int64_t n, const float* const*, const float** vr) const { walk(v, vt, s0, n, vr); }
};

struct Batch {
  const float* q;
  int64_t qn, qh;  // q[n * qn + h * qh + d]
  int64_t H, group, D;
  const int64_t* seqs;  // [N, kSeqFields]
  const float* sinks;   // [H] or null
  float scale;
  float* out;         // [N, H, D]
  const int64_t* at;  // the rows of this turn: task i is row at[i / Hkv]
};

// Whether a row's cache is a bf16 / fp8 one read through cache_rows.h (its table fields 0).
bool cached(const int64_t* seq) { return seq[kKeyTable] == 0; }

const CacheRows& cache_of(const int64_t* seq, Field pool) { return *reinterpret_cast<const CacheRows*>(seq[pool]); }

float* row_at(const int64_t* seq, Field pool, Field table, Field stride, int64_t h, int64_t pos, int64_t D) {
  const int64_t block = seq[kBlock];
  const int64_t* t = reinterpret_cast<const int64_t*>(seq[table]);
  return reinterpret_cast<float*>(seq[pool]) + h * seq[stride] + (t[pos / block] * block + pos % block) * D;
}

// Tasks i0 .. i1 of a turn's rows x Hkv: row n = at[i / Hkv], KV head i % Hkv and the `group` query heads that
// read it.
void heads(const void* ctx, int64_t i0, int64_t i1) {
  const Batch& a = *static_cast<const Batch*>(ctx);
  const int64_t Hkv = a.H / a.group;
  thread_local std::vector<float> buf;  // a cached row's widened keys and values [kKeys, D] each
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t n = a.at[i / Hkv], kvh = i % Hkv, h = kvh * a.group;
    const int64_t* seq = a.seqs + n * kSeqFields;
    const auto attend = [&](const auto& rows) {
      group_heads(a.q + n * a.qn + h * a.qh, a.qh, a.group, rows, seq[kFirst], seq[kPos] + 1, nullptr,
                  a.sinks ? a.sinks + h : nullptr, a.scale, a.D, a.out + (n * a.H + h) * a.D);
    };
    if (cached(seq)) {
      buf.resize(2 * kKeys * a.D);
      attend(CachedRows{&cache_of(seq, kKeyPool), &cache_of(seq, kValuePool), kvh, seq[kPos] + 1, buf.data(),
                        buf.data() + kKeys * a.D});
    } else {
      attend(PagedRows{reinterpret_cast<const float*>(seq[kKeyPool]) + kvh * seq[kKeyStride],
                       reinterpret_cast<const float*>(seq[kValuePool]) + kvh * seq[kValueStride],
                       reinterpret_cast<const int64_t*>(seq[kKeyTable]),
                       reinterpret_cast<const int64_t*>(seq[kValueTable]), seq[kBlock], a.D});
    }
  }
}

}  // namespace

extern "C" {

// Writes k/v rows [N, Hkv, D] (k[n * kn + h * kh + d], likewise v) into each row's cache, then
// out [N, H, D] = each row's attention (see the top of this file); seqs [N, 10] int64: key pool,
// key block table, key head stride, value pool, value block table, value head stride, block,
// capacity (positions the tables hold), pos, first (a bf16 / fp8 cache: the key CacheRows' address, 0, 0,
// the value CacheRows' address, 0, 0, 1, capacity, pos, first). H = Hkv * group. Returns -1, or the first row whose
// position lies outside [0, capacity) (then nothing is written).
int64_t gqa_decode_paged(const float* q, int64_t qn, int64_t qh, const float* k, int64_t kn, int64_t kh,
                         const float* v, int64_t vn, int64_t vh, int64_t N, int64_t H, int64_t group, int64_t D,
                         const int64_t* seqs, const float* sinks, float scale, float* out, int threads) {
  const int64_t Hkv = H / group;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t* seq = seqs + n * kSeqFields;
    if (seq[kPos] < 0 || seq[kPos] >= seq[kCapacity]) return n;
  }
  // turn[n]: how many earlier rows write the same bf16 / fp8 cache (0 for fp32 rows: their pools keep every row)
  std::vector<int64_t> turn(N, 0), at;
  std::vector<float> gathered;
  int64_t turns = 1;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t* seq = seqs + n * kSeqFields;
    if (!cached(seq)) continue;
    for (int64_t m = 0; m < n; ++m) {
      const int64_t* earlier = seqs + m * kSeqFields;
      turn[n] += cached(earlier) && cache_of(earlier, kKeyPool).pool == cache_of(seq, kKeyPool).pool;
    }
    turns = std::max(turns, turn[n] + 1);
  }
  for (int64_t t = 0; t < turns; ++t) {
    at.clear();
    int64_t keys = 0;
    for (int64_t n = 0; n < N; ++n) {
      if (turn[n] != t) continue;
      const int64_t* seq = seqs + n * kSeqFields;
      if (cached(seq)) {  // the heads' rows side by side, as cache_rows.h writes them
        gathered.resize(2 * Hkv * D);
        for (int64_t h = 0; h < Hkv; ++h) {
          std::copy_n(k + n * kn + h * kh, D, gathered.data() + h * D);
          std::copy_n(v + n * vn + h * vh, D, gathered.data() + (Hkv + h) * D);
        }
        localmoe_cache::write(cache_of(seq, kKeyPool), seq[kPos], gathered.data());
        localmoe_cache::write(cache_of(seq, kValuePool), seq[kPos], gathered.data() + Hkv * D);
      } else {
        for (int64_t h = 0; h < Hkv; ++h) {
          std::copy_n(k + n * kn + h * kh, D, row_at(seq, kKeyPool, kKeyTable, kKeyStride, h, seq[kPos], D));
          std::copy_n(v + n * vn + h * vh, D, row_at(seq, kValuePool, kValueTable, kValueStride, h, seq[kPos], D));
        }
      }
      keys += std::max<int64_t>(1, seq[kPos] + 1 - seq[kFirst]);
      at.push_back(n);
    }
    const int64_t rows = static_cast<int64_t>(at.size());
    const Batch batch{q, qn, qh, H, group, D, seqs, sinks, scale, out, at.data()};
    const int64_t bytes_per_task = std::max<int64_t>(1, keys / std::max<int64_t>(rows, 1) * D * 8);
    localmoe::parallel(heads, &batch, rows * Hkv, localmoe::kChunkBytes / bytes_per_task, threads);
  }
  return -1;
}

}  // extern "C"
