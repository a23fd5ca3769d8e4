// Every layer of a model for one decode token, in one call: `decode_gqa_moe` for GQA + routed-MXFP4-MoE
// models (gpt-oss), `decode_dense` for GQA + SiLU-gated dense MLP models (Llama, SmolLM2, Qwen2,
// Qwen3 with its per-head q/k norms), and their rows forms `decode_gqa_moe_rows` / `decode_dense_rows`: N
// sequences at once over their paged caches (the batched decode step, a speculative verify's consecutive
// positions), each row with the bits the one-token call gives it alone.
//
// Per layer, with x the residual stream [D] and h its normed copy:
//   h = add_rms_norm(x, -, attn_norm)                       (first layer only; later ones get h below)
//   a = gqa_step(h)                                          QKV GEMV, RoPE, cache write, attention, O GEMV
//   h = add_rms_norm(x += a, mlp_norm)
//   m = mxfp4_moe_routed(h)                                  router GEMV, routing, experts
//   h = add_rms_norm(x += m, next layer's attn_norm, or the final norm after the last layer)
// which is what engine/transformer.py runs op by op, through the same kernel entry points (so the bits
// are the same). A bf16 / fp8 K/V cache (--kv-cache-dtype) is read and written in its own dtype, as the hybrid
// plan's GQA layers do: the one-token calls through a layer's `keys` / `values` (fp8_cache/cache_rows.h views;
// gqa_step.h attention_step_cached), the rows calls through paged_cpu.cpp's cached rows (the same reader).
// Python between those calls (argument checks, views, allocations, ctypes) cost more
// than 1 ms per token on a small model: a third of the attention and MoE kernels' own time.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../_cpu/glu.h"
#include "../gqa_decode/gqa_step.h"

extern "C" {
void add_rms_norm(float* x, const float* delta, const float* weight, int64_t N, int64_t D, float eps, float* out);
int64_t gqa_decode_paged(const float* q, int64_t qn, int64_t qh, const float* k, int64_t kn, int64_t kh,
                         const float* v, int64_t vn, int64_t vh, int64_t N, int64_t H, int64_t group, int64_t D,
                         const int64_t* seqs, const float* sinks, float scale, float* out, int threads);
void gqa_step(const float* x, int64_t hidden, const void* wqkv, int qkv_bf16, const float* bqkv, int64_t H,
              int64_t Hkv, int64_t D, int64_t rot, const float* cos, const float* ssin, float* kpool, float* vpool,
              int64_t head_stride, int64_t pos, int64_t first, const float* sinks, float scale, const float* q_norm,
              const float* k_norm, float eps, const void* wo, int o_bf16, const float* bo, float* out,
              float* scratch, int threads);
void mxfp4_moe_routed(const float* rx, int64_t R, const float* router_w, const float* router_b, const float* correction,
                      int scoring, int renormalize, float scaling, const float* x, int64_t N, int64_t D, int64_t I,
                      int64_t k, const int64_t* table, int64_t E, int glu, float p0, float p1, float* out,
                      int64_t* ids_out, float* weights_out, void* scratch, int threads, int q8);
}

// A paged MoE layer's routed experts (a layer whose `table` is null): out [N, D] (zeroed) += the experts of the N
// rows h [N, D], routed and run by the engine (kernels/decode_layers GqaMoeDecoder: the pager's router hooks, its
// slots; the same kernels and order as a resident table's). Returns 0, or nonzero where the engine failed.
typedef int (*MoeExperts)(int64_t layer, int64_t N, const float* h, float* out);

// One layer's weights and cache, as kernels/decode_layers/__init__.py `Layer` (ctypes) lays it out.
struct Layer {
  const float* attn_norm;
  const void* wqkv;
  const float* bqkv;
  const void* wo;
  const float* bo;
  const float* sinks;
  float* kpool;
  float* vpool;
  int64_t qkv_bf16, o_bf16, heads, kv_heads, head_dim, rot, head_stride, window;
  float scale;
  const float* mlp_norm;
  const float* router_w;
  const float* router_b;
  const float* correction;
  const int64_t* table;
  int64_t scoring, renormalize, experts, intermediate, top_k, glu;
  float scaling, p0, p1;
  localmoe_cache::CacheRows keys, values;  // a bf16 / fp8 cache in its own dtype (keys.pool null: fp32 kpool, vpool)
};

namespace {

// A gpt-oss layer's MoE over rows h [N, D] into delta [N, D] (zeroed here): with a resident table, routing and
// experts in one mxfp4_moe_routed call per slice of at most `slice` rows (every expert's group then takes each
// token's own path: a row's bits are its bits alone); without one (paged), `experts` (one call for all N rows).
// Returns false where `experts` failed.
bool moe_rows(const Layer& L, int64_t l, float* h, int64_t N, int64_t D, int64_t slice, float* delta,
              int64_t* ids, float* weights, void* scratch, MoeExperts experts, int threads, int q8) {
  std::memset(delta, 0, N * D * sizeof(float));
  if (L.table == nullptr) return experts(l, N, h, delta) == 0;
  for (int64_t r = 0; r < N; r += slice) {
    const int64_t n = std::min(slice, N - r);
    mxfp4_moe_routed(h + r * D, D, L.router_w, L.router_b, L.correction, static_cast<int>(L.scoring),
                     static_cast<int>(L.renormalize), L.scaling, h + r * D, n, D, L.intermediate, L.top_k, L.table,
                     L.experts, static_cast<int>(L.glu), L.p0, L.p1, delta + r * D, ids, weights, scratch, threads,
                     q8);
  }
  return true;
}

constexpr int64_t kFields = 10, kCapacity = 7, kPos = 8;  // paged_cpu.cpp's row fields

// -1, or the first (layer * N + row) of seqs [n, N, kFields] whose position lies outside its cache's capacity.
int64_t outside(const int64_t* seqs, int64_t n, int64_t N) {
  for (int64_t i = 0; i < n * N; ++i) {
    const int64_t* seq = seqs + i * kFields;
    if (seq[kPos] < 0 || seq[kPos] >= seq[kCapacity]) return i;
  }
  return -1;
}

// One GQA layer's attention for N rows h [N, D] -> delta [N, D] (decode_dense_rows and decode_gqa_moe_rows): the
// q/k/v matrix read once for all rows (`matrows`), per row the q/k norms and RoPE as attention_step, every row's
// k/v written and each (row, KV head) attended by kernels/gqa_decode paged_cpu.cpp with the instructions of
// attention_step's contiguous pass, then the output matrix once for all rows: each row's bits are attention_step's.
// seqs [N, kFields]: this layer's rows; work: [N, (2 H + 2 Hkv) Dh] floats; parts: a stacked matrix's parts.
void attention_rows(const localmoe::Matrix& qkv_w, const localmoe::Matrix& o_w, int64_t H, int64_t Hkv, int64_t Dh,
                    int64_t rot, const float* q_norm, const float* k_norm, const float* sinks, float scale, float eps,
                    const float* h, int64_t N, const int64_t* seqs, const float* cos, const float* ssin,
                    int64_t rope_stride, float* delta, float* work, float* parts, void* xq, int threads) {
  const int64_t width = (H + 2 * Hkv) * Dh;
  float* qkv = work;              // [N, width]
  float* attn = work + N * width;  // [N, H Dh]
  localmoe::matrows(qkv_w, h, N, qkv, xq, threads, parts);
  for (int64_t r = 0; r < N; ++r) {
    float* row = qkv + r * width;
    if (q_norm != nullptr)
      for (int64_t j = 0; j < H + Hkv; ++j)
        localmoe_gqa::head_rms_norm(row + j * Dh, Dh, j < H ? q_norm : k_norm, eps);
    for (int64_t j = 0; j < H + Hkv; ++j)
      localmoe_gqa::rope(row + j * Dh, rot, cos + r * rope_stride, ssin + r * rope_stride);
  }
  gqa_decode_paged(qkv, width, Dh, qkv + H * Dh, width, Dh, qkv + (H + Hkv) * Dh, width, Dh, N, H, H / Hkv, Dh, seqs,
                   sinks, scale, attn, threads);
  localmoe::matrows(o_w, attn, N, delta, xq, threads);
}

localmoe::Matrix qkv_matrix(const Layer& L, int64_t D) {
  return {L.wqkv, L.qkv_bf16 ? localmoe::kBF16 : localmoe::kF32, (L.heads + 2 * L.kv_heads) * L.head_dim, D, L.bqkv};
}

localmoe::Matrix o_matrix(const Layer& L, int64_t D) {
  return {L.wo, L.o_bf16 ? localmoe::kBF16 : localmoe::kF32, D, L.heads * L.head_dim, L.bo};
}

}  // namespace

extern "C" {

// x [D] (the embedded token; the residual stream, updated) -> h [D], the final-normed hidden state.
// cos/ssin [rot]: the RoPE tables at `pos`; delta [D], ids/weights [max k], attn_scratch (floats) and
// moe_scratch (bytes) sized by the caller for the largest layer; experts: the paged layers' (table null).
// Returns -1, or the layer whose `experts` failed.
int64_t decode_gqa_moe(const Layer* layers, int64_t n, float* x, int64_t D, int64_t pos, const float* cos,
                       const float* ssin, const float* final_norm, float eps, int q8, float* h, float* delta,
                       int64_t* ids, float* weights, float* attn_scratch, void* moe_scratch, MoeExperts experts,
                       int threads) {
  add_rms_norm(x, nullptr, layers[0].attn_norm, 1, D, eps, h);
  for (int64_t l = 0; l < n; ++l) {
    const Layer& L = layers[l];
    const int64_t first = L.window ? std::max<int64_t>(0, pos + 1 - L.window) : 0;
    if (L.keys.pool != nullptr)  // gqa_step's projections (fp32 / bf16 matrices need no xq) over the cache's dtype
      localmoe_gqa::attention_step_cached(h, qkv_matrix(L, D), o_matrix(L, D), L.heads, L.kv_heads, L.head_dim,
                                          L.rot, cos, ssin, L.keys, L.values, pos, first, L.sinks, L.scale, nullptr,
                                          nullptr, 0.0f, delta, attn_scratch, nullptr, threads);
    else
      gqa_step(h, D, L.wqkv, static_cast<int>(L.qkv_bf16), L.bqkv, L.heads, L.kv_heads, L.head_dim, L.rot, cos, ssin,
             L.kpool, L.vpool, L.head_stride, pos, first, L.sinks, L.scale, nullptr, nullptr, 0.0f, L.wo,
             static_cast<int>(L.o_bf16), L.bo, delta, attn_scratch, threads);
    add_rms_norm(x, delta, L.mlp_norm, 1, D, eps, h);
    if (!moe_rows(L, l, h, 1, D, 1, delta, ids, weights, moe_scratch, experts, threads, q8)) return l;
    add_rms_norm(x, delta, l + 1 < n ? layers[l + 1].attn_norm : final_norm, 1, D, eps, h);
  }
  return -1;
}

// Floats of decode_gqa_moe_rows' `work` per row: the largest layer's q/k/v and attention rows.
int64_t decode_gqa_moe_rows_work(const Layer* layers, int64_t n) {
  int64_t floats = 0;
  for (int64_t l = 0; l < n; ++l)
    floats = std::max(floats, (2 * layers[l].heads + 2 * layers[l].kv_heads) * layers[l].head_dim);
  return floats;
}

// decode_gqa_moe for N rows (N sequences' tokens, or consecutive tokens of one sequence: a speculative verify, a
// prompt chunk), as decode_dense_rows lays them out: x [N, D] (updated) -> h [N, D]. Each row's arithmetic is
// decode_gqa_moe's for its token: the attention by `attention_rows` (attention_step's bits per row), the norms per
// row, the MoE by `moe_rows` (mxfp4_moe_routed over slices of at most moe_rows rows: at exact precision a slice's
// expert groups must stay on the one-token path, EXACT_TOKEN_ROWS; paged layers through `experts`, which runs the
// same kernels in the same order). So a row has the bits `decode_gqa_moe` gives its sequence alone, whatever the
// other rows and threads. seqs [n, N, 10] (paged_cpu.cpp's row fields per layer), cos/ssin [N, rope_stride]; delta
// [N, D]; work: decode_gqa_moe_rows_work floats per row; ids/weights [moe_rows, max k]; moe_scratch:
// mxfp4_moe_routed_scratch bytes for moe_rows rows of the largest layer. Returns -1; the first (layer * N + row)
// whose position lies outside its cache's capacity (nothing computed or written); or n * N + the layer whose
// `experts` failed.
int64_t decode_gqa_moe_rows(const Layer* layers, int64_t n, int64_t N, float* x, int64_t D, const int64_t* seqs,
                            const float* cos, const float* ssin, int64_t rope_stride, const float* final_norm,
                            float eps, int q8, int64_t moe_rows_max, float* h, float* delta, float* work,
                            int64_t* ids, float* weights, void* moe_scratch, MoeExperts experts, int threads) {
  const int64_t bad = outside(seqs, n, N);
  if (bad >= 0) return bad;
  add_rms_norm(x, nullptr, layers[0].attn_norm, N, D, eps, h);
  for (int64_t l = 0; l < n; ++l) {
    const Layer& L = layers[l];
    attention_rows(qkv_matrix(L, D), o_matrix(L, D), L.heads, L.kv_heads, L.head_dim, L.rot, nullptr, nullptr, L.sinks,
                   L.scale, eps, h, N, seqs + l * N * kFields, cos, ssin, rope_stride, delta, work, nullptr, nullptr,
                   threads);
    add_rms_norm(x, delta, L.mlp_norm, N, D, eps, h);
    if (!moe_rows(L, l, h, N, D, moe_rows_max, delta, ids, weights, moe_scratch, experts, threads, q8))
      return n * N + l;
    add_rms_norm(x, delta, l + 1 < n ? layers[l + 1].attn_norm : final_norm, N, D, eps, h);
  }
  return -1;
}

// A dense layer (decode_dense): the attention as in Layer, with its matrices as descriptors of any type
// matrix.h reads (fp32, bf16, GGUF blocks), and a SiLU-gated MLP: gate_up rows [gate I | up I], down.
struct DenseLayer {
  const float* attn_norm;
  localmoe::Matrix qkv, o;
  const float* q_norm;  // [head_dim] or null (Qwen3), eps the model's
  const float* k_norm;
  const float* sinks;
  float* kpool;
  float* vpool;
  int64_t heads, kv_heads, head_dim, rot, head_stride, window;
  float scale;
  const float* mlp_norm;
  localmoe::Matrix gate_up, down;
  localmoe_cache::CacheRows keys, values;  // a bf16 / fp8 cache in its own dtype (keys.pool null: fp32 kpool, vpool)
};

// Bytes of the `xq` scratch decode_dense needs for inputs of up to K values.
int64_t decode_dense_xq_bytes(int64_t K) { return localmoe::matvec_scratch(K); }

// As decode_gqa_moe for dense layers: x [D] (updated) -> h [D]; attn_scratch: gqa_step.h step_scratch floats of
// the largest layer, mlp [2 I] floats, xq: matrix.h matvec_scratch bytes of the widest input.
void decode_dense(const DenseLayer* layers, int64_t n, float* x, int64_t D, int64_t pos, const float* cos,
                  const float* ssin, const float* final_norm, float eps, float* h, float* delta, float* attn_scratch,
                  float* mlp, void* xq, int threads) {
  add_rms_norm(x, nullptr, layers[0].attn_norm, 1, D, eps, h);
  for (int64_t l = 0; l < n; ++l) {
    const DenseLayer& L = layers[l];
    const int64_t first = L.window ? std::max<int64_t>(0, pos + 1 - L.window) : 0;
    if (L.keys.pool != nullptr)
      localmoe_gqa::attention_step_cached(h, L.qkv, L.o, L.heads, L.kv_heads, L.head_dim, L.rot, cos, ssin, L.keys,
                                          L.values, pos, first, L.sinks, L.scale, L.q_norm, L.k_norm, eps, delta,
                                          attn_scratch, xq, threads);
    else
      localmoe_gqa::attention_step(h, L.qkv, L.o, L.heads, L.kv_heads, L.head_dim, L.rot, cos, ssin, L.kpool,
                                   L.vpool, L.head_stride, pos, first, L.sinks, L.scale, L.q_norm, L.k_norm, eps,
                                   delta, attn_scratch, xq, threads);
    add_rms_norm(x, delta, L.mlp_norm, 1, D, eps, h);
    const int64_t I = L.gate_up.rows / 2;
    localmoe::matvec(L.gate_up, h, mlp, xq, threads);
    localmoe::glu_rows(localmoe::kSwiGLU, mlp, mlp + I, I, 0.0f, 0.0f);  // silu(gate) * up
    localmoe::matvec(L.down, mlp, delta, xq, threads);
    add_rms_norm(x, delta, l + 1 < n ? layers[l + 1].attn_norm : final_norm, 1, D, eps, h);
  }
}

// Bytes of the `xq` scratch decode_dense_rows needs for N rows of up to K values.
int64_t decode_dense_rows_xq_bytes(int64_t N, int64_t K) { return localmoe::matrows_scratch(N, K); }

// Floats of decode_dense_rows' `work` per row: the largest layer's q/k/v and attention rows, or its gate/up rows,
// then as many again for a stacked matrix's parts (matrix.h `matrows`).
int64_t decode_dense_rows_work(const DenseLayer* layers, int64_t n) {
  int64_t floats = 0;
  for (int64_t l = 0; l < n; ++l) {
    const DenseLayer& L = layers[l];
    floats = std::max({floats, (2 * L.heads + 2 * L.kv_heads) * L.head_dim, L.gate_up.rows});
  }
  return 2 * floats;
}

// decode_dense for N sequences, one new token each (row r: a sequence's token, or one of several consecutive
// tokens of a sequence, as engine/batch.py forward_rows lays them out): x [N, D] (updated) -> h [N, D]. Each
// matrix is read once for all rows (`matrows`); the norms, RoPE, q/k norms and SiLU run per row as in
// decode_dense, and the attention is kernels/gqa_decode paged_cpu.cpp over each row's paged cache (every row's
// k/v written first, then each (row, KV head) with the same instructions as decode_dense's contiguous pass).
// So a row's bits are those decode_dense gives its sequence alone, whatever the other rows and threads.
// seqs [n, N, 10] int64: layer l's paged_cpu.cpp row fields (pools, tables, strides, block, capacity, pos,
// first); cos/ssin [N, rope_stride]: each row's RoPE tables; delta [N, D]; work: decode_dense_rows_work floats per
// row; xq: decode_dense_rows_xq_bytes(N, widest input). Returns -1, or the first (layer * N + row) whose
// position lies outside its cache's capacity (then nothing is computed or written).
int64_t decode_dense_rows(const DenseLayer* layers, int64_t n, int64_t N, float* x, int64_t D, const int64_t* seqs,
                          const float* cos, const float* ssin, int64_t rope_stride, const float* final_norm, float eps,
                          float* h, float* delta, float* work, void* xq, int threads) {
  const int64_t bad = outside(seqs, n, N);
  if (bad >= 0) return bad;
  const int64_t work_floats = decode_dense_rows_work(layers, n);
  add_rms_norm(x, nullptr, layers[0].attn_norm, N, D, eps, h);
  for (int64_t l = 0; l < n; ++l) {
    const DenseLayer& L = layers[l];
    float* parts = work + N * (work_floats / 2);  // a stacked matrix's parts
    attention_rows(L.qkv, L.o, L.heads, L.kv_heads, L.head_dim, L.rot, L.q_norm, L.k_norm, L.sinks, L.scale, eps, h, N,
                   seqs + l * N * kFields, cos, ssin, rope_stride, delta, work, parts, xq, threads);
    add_rms_norm(x, delta, L.mlp_norm, N, D, eps, h);
    const int64_t I = L.gate_up.rows / 2;
    float* mlp = work;  // [N, 2 I], then silu(gate) * up packed as [N, I]
    localmoe::matrows(L.gate_up, h, N, mlp, xq, threads, parts);
    for (int64_t r = 0; r < N; ++r) {
      localmoe::glu_rows(localmoe::kSwiGLU, mlp + r * 2 * I, mlp + r * 2 * I + I, I, 0.0f, 0.0f);
      if (r > 0) std::memmove(mlp + r * I, mlp + r * 2 * I, I * sizeof(float));  // over rows consumed already
    }
    localmoe::matrows(L.down, mlp, N, delta, xq, threads);
    add_rms_norm(x, delta, l + 1 < n ? layers[l + 1].attn_norm : final_norm, N, D, eps, h);
  }
  return -1;
}

}  // extern "C"
