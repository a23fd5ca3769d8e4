// Every layer of a model for one decode token, in one call: `decode_gqa_moe` for GQA + routed-MXFP4-MoE
// models (gpt-oss), `decode_dense` for GQA + SiLU-gated dense MLP models (Llama, SmolLM2, Qwen2,
// Qwen3 with its per-head q/k norms), and `decode_dense_rows`: decode_dense for N sequences at once over
// their paged caches (the batched decode step), each row with the bits decode_dense gives it alone.
//
// Per layer, with x the residual stream [D] and h its normed copy:
//   h = add_rms_norm(x, -, attn_norm)                       (first layer only; later ones get h below)
//   a = gqa_step(h)                                          QKV GEMV, RoPE, cache write, attention, O GEMV
//   h = add_rms_norm(x += a, mlp_norm)
//   m = mxfp4_moe_routed(h)                                  router GEMV, routing, experts
//   h = add_rms_norm(x += m, next layer's attn_norm, or the final norm after the last layer)
// which is what engine/transformer.py runs op by op, through the same kernel entry points (so the bits
// are the same). Python between those calls (argument checks, views, allocations, ctypes) cost more
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
};

extern "C" {

// x [D] (the embedded token; the residual stream, updated) -> h [D], the final-normed hidden state.
// cos/ssin [rot]: the RoPE tables at `pos`; delta [D], ids/weights [max k], attn_scratch (floats) and
// moe_scratch (bytes) sized by the caller for the largest layer.
void decode_gqa_moe(const Layer* layers, int64_t n, float* x, int64_t D, int64_t pos, const float* cos,
                    const float* ssin, const float* final_norm, float eps, int q8, float* h, float* delta,
                    int64_t* ids, float* weights, float* attn_scratch, void* moe_scratch, int threads) {
  add_rms_norm(x, nullptr, layers[0].attn_norm, 1, D, eps, h);
  for (int64_t l = 0; l < n; ++l) {
    const Layer& L = layers[l];
    const int64_t first = L.window ? std::max<int64_t>(0, pos + 1 - L.window) : 0;
    gqa_step(h, D, L.wqkv, static_cast<int>(L.qkv_bf16), L.bqkv, L.heads, L.kv_heads, L.head_dim, L.rot, cos, ssin,
             L.kpool, L.vpool, L.head_stride, pos, first, L.sinks, L.scale, nullptr, nullptr, 0.0f, L.wo,
             static_cast<int>(L.o_bf16), L.bo, delta, attn_scratch, threads);
    add_rms_norm(x, delta, L.mlp_norm, 1, D, eps, h);
    std::memset(delta, 0, D * sizeof(float));
    mxfp4_moe_routed(h, D, L.router_w, L.router_b, L.correction, static_cast<int>(L.scoring),
                     static_cast<int>(L.renormalize), L.scaling, h, 1, D, L.intermediate, L.top_k, L.table, L.experts,
                     static_cast<int>(L.glu), L.p0, L.p1, delta, ids, weights, moe_scratch, threads, q8);
    add_rms_norm(x, delta, l + 1 < n ? layers[l + 1].attn_norm : final_norm, 1, D, eps, h);
  }
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
    localmoe_gqa::attention_step(h, L.qkv, L.o, L.heads, L.kv_heads, L.head_dim, L.rot, cos, ssin, L.kpool, L.vpool,
                                 L.head_stride, pos, first, L.sinks, L.scale, L.q_norm, L.k_norm, eps, delta,
                                 attn_scratch, xq, threads);
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
  constexpr int64_t kFields = 10, kCapacity = 7, kPos = 8;  // paged_cpu.cpp's row fields
  for (int64_t i = 0; i < n * N; ++i) {
    const int64_t* seq = seqs + i * kFields;
    if (seq[kPos] < 0 || seq[kPos] >= seq[kCapacity]) return i;
  }
  const int64_t work_floats = decode_dense_rows_work(layers, n);
  add_rms_norm(x, nullptr, layers[0].attn_norm, N, D, eps, h);
  for (int64_t l = 0; l < n; ++l) {
    const DenseLayer& L = layers[l];
    const int64_t H = L.heads, Hkv = L.kv_heads, Dh = L.head_dim, width = (H + 2 * Hkv) * Dh;
    float* qkv = work;              // [N, width]
    float* attn = work + N * width;  // [N, H Dh]
    float* parts = work + N * (work_floats / 2);  // a stacked matrix's parts
    localmoe::matrows(L.qkv, h, N, qkv, xq, threads, parts);
    for (int64_t r = 0; r < N; ++r) {
      float* row = qkv + r * width;
      if (L.q_norm != nullptr)
        for (int64_t j = 0; j < H + Hkv; ++j)
          localmoe_gqa::head_rms_norm(row + j * Dh, Dh, j < H ? L.q_norm : L.k_norm, eps);
      for (int64_t j = 0; j < H + Hkv; ++j)
        localmoe_gqa::rope(row + j * Dh, L.rot, cos + r * rope_stride, ssin + r * rope_stride);
    }
    gqa_decode_paged(qkv, width, Dh, qkv + H * Dh, width, Dh, qkv + (H + Hkv) * Dh, width, Dh, N, H, H / Hkv, Dh,
                     seqs + l * N * kFields, L.sinks, L.scale, attn, threads);
    localmoe::matrows(L.o, attn, N, delta, xq, threads);
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
