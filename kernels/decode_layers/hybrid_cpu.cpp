// Every layer of a hybrid model for one decode token, in one call: KDA, Gated DeltaNet and absorbed MLA
// mixers (hybrid_mixers.h; MLA with DSA's lightning or k-pool indexer and top-k, or a dsa_shared selection)
// or GQA (gqa_step.h, with Qwen3-Next's sigmoid output gate), a dense gated MLP or a MoE block (optional
// latent projection: down, experts, norm, up; optional shared experts, optionally behind a sigmoid gate),
// and plain residuals, Kimi K3's attention residuals (depth mixing over stored block representations) or
// GLM-5-Next's hyper-connections (hc_mult streams mixed around each sublayer). Kimi K3, Kimi-Linear, Qwen3-Next, DeepSeek-V3 / V3.2, Kimi K2.5 and GLM-5 decode through it
// (engine/decode_plan.py). Per layer, as engine/transformer.py and engine/layers/attn_res.py run it op by op:
//   plain:     a = mixer(rms(x)); x += a; m = mlp(rms(x)); x += m
//   attn-res:  h = mix([blocks, ps], attn_query) (ps alone before the first block); every block_size
//              layers ps is stored as a block and restarted; ps (+)= mixer(rms(h));
//              h = mix([blocks, ps], mlp_query); ps += mlp(rms(h)); at the end mix(output_query)
// then the final norm. Routed experts run through mxfp4_moe_routed (routing in C) where the layer holds
// a resident MXFP4 table, through the same routing and `dense_expert` per chosen expert (increasing id)
// where it holds resident dense experts, through ggml_moe_token (the same rows, glu and order) where it holds
// resident GGUF-block experts, else through `experts`, a callback into the engine (a pager):
// the callback routes h and runs the experts on the experts' input, giving the same bits as the
// table call, so paged decode equals resident decode bit for bit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../_cpu/glu.h"
#include "../gqa_decode/gqa_step.h"
#include "hybrid_mixers.h"

using localmoe::Matrix;
using localmoe_hybrid::dot;
using localmoe_hybrid::rms_norm;

extern "C" {
void mxfp4_moe_routed(const float* rx, int64_t R, const float* router_w, const float* router_b, const float* correction,
                      int scoring, int renormalize, float scaling, const float* x, int64_t N, int64_t D, int64_t I,
                      int64_t k, const int64_t* table, int64_t E, int glu, float p0, float p1, float* out,
                      int64_t* ids_out, float* weights_out, void* scratch, int threads, int q8);
void mxfp4_route(const float* rx, int64_t R, const float* router_w, const float* router_b, const float* correction,
                 int scoring, int renormalize, float scaling, int64_t N, int64_t k, int64_t E, int64_t* ids_out,
                 float* weights_out, float* logits, int threads);
void dense_expert(const float* x, const Matrix* gate, const Matrix* up, const Matrix* down, int glu, float p0, float p1,
                  float weight, float* out, float* scratch, void* xq, int threads);
void dense_experts_token(const float* x, int64_t W, int64_t I, const int64_t* ids, const float* weights, int64_t k,
                         const int64_t* table, int64_t type, int glu, float p0, float p1, float* out, float* scratch,
                         void* xq, int threads);
int ggml_moe_token(const float* x, int64_t W, int64_t I, const int64_t* ids, const float* weights, int64_t k,
                   const int64_t* table, const int64_t* types, int glu, float p0, float p1, float* out, void* scratch,
                   int threads);
int64_t ggml_moe_token_scratch(int64_t k, int64_t W, int64_t I);
int64_t mxfp4_moe_routed_scratch(int64_t N, int64_t k, int64_t D, int64_t I, int64_t E);
}

// A GQA mixer: qkv rows [q H D | k Hkv D | v Hkv D], per-head q/k RMSNorm (null: none), RoPE over the
// first `rot` dims, the K/V pools written in place (fp32 pools, or, where `keys.pool` is set, bf16 / fp8
// caches through cache_rows.h), an optional output gate [H D, hidden].
struct Gqa {
  Matrix qkv, gate;
  const float* q_norm;
  const float* k_norm;
  const float* sinks;
  float* kpool;
  float* vpool;
  int64_t heads, kv_heads, head_dim, rot, head_stride, window;
  float scale, eps;
  localmoe_cache::CacheRows keys, values;
};

// One layer, as kernels/decode_layers/hybrid.py `HybridLayer` (ctypes) lays it out.
struct HybridLayer {
  const float* attn_norm;
  const float* mlp_norm;
  const float* attn_query;  // attention-residual pseudo-queries [D]; null under plain residuals
  const float* mlp_query;
  int64_t mixer;  // 0 KDA, 1 MLA, 2 Gated DeltaNet, 3 GQA
  localmoe_hybrid::Kda kda;
  localmoe_hybrid::Mla mla;
  localmoe_hybrid::Gdn gdn;
  Gqa gqa;
  Matrix o_proj;  // the mixer's output projection [D, H v]
  // MLP: a dense gated MLP (moe 0), or the MoE's shared experts (rows 0: none)
  int64_t moe;
  Matrix gate_up, down;  // [gate I; up I] rows, [D, I]
  int64_t glu;           // glu.h kind of the dense MLP / shared experts
  float glu_p0, glu_p1;
  const float* shared_gate;  // [D]: shared experts scaled by sigmoid(shared_gate . h) (Qwen3-Next); or null
  Matrix lat_down, lat_up;  // latent MoE [L, D], [D, L]; rows 0: experts at the hidden width
  const float* lat_norm;    // [L]
  float lat_eps;
  const float* router_w;  // [E, D] fp32
  const float* router_b;
  const float* correction;
  const int64_t* table;  // resident MXFP4 experts (ExpertTable.addresses); null: `dense` or the callback
  const int64_t* dense;  // resident dense experts [E, 3]: gate, up, down of type dense_type; null: the callback
  int64_t scoring, renormalize, experts, intermediate, top_k, expert_glu, dense_type;
  float scaling, p0, p1;
  const int64_t* blocks;   // resident GGUF-block experts [E, 3] (kernels/ggml_gemv ggml_moe_cpu.cpp); null: none
  int64_t block_types[3];  // their gate, up, down GGMLQuantizationType
  // GLM-5-Next's hyper-connections around the mixer (attn) and the MLP (ffn): fn [(2 + N) N, N D] fp32, base
  // [(2 + N) N], scale [3]; hc_mult N (layer 0's): 0 without them, hc_iters Sinkhorn rounds, hc_eps their floor
  Matrix hc_attn, hc_ffn;
  const float* hc_attn_base;
  const float* hc_attn_scale;
  const float* hc_ffn_base;
  const float* hc_ffn_scale;
  int64_t hc_mult, hc_iters;
  float hc_eps;
};

// (layer index, rows N, h [N, D] the MoE input, x [N, W] the experts' input, out [N, W] zeroed) -> 0, or nonzero to
// stop. The one-token step calls it with N = 1, the rows step once per layer for all its rows.
typedef int (*ExpertsFn)(int64_t layer, int64_t N, const float* h, const float* x, float* out);

// A call's arguments, as kernels/decode_layers/hybrid.py `HybridCall` (ctypes) lays them out: built once by the
// decoder, the few that change per token (x, pos, the RoPE tables, h, logits, threads) set before each call.
struct HybridCall {
  const HybridLayer* layers;
  int64_t n;           // layers
  float* x;            // [D] (decode_hybrid_rows: [N, D]): the embedded token(s), the residual stream (updated)
  int64_t D, pos;      // hidden size; the token's cache position (decode_hybrid)
  const float* cos;    // RoPE tables at the rotary position ([N, rope_stride] for rows), or null
  const float* ssin;
  int64_t block_size;  // 0: plain residuals (or hyper-connections), else attention residuals
  const float* output_query;
  const float* final_norm;
  float eps;
  int64_t q8;
  float* h;  // the final-normed hidden state [D] ([N, D])
  const Matrix* head;  // the lm_head in the call (decode_hybrid), or null
  float* logits;
  int64_t* ids;
  float* weights;
  float* scratch;  // decode_hybrid_scratch floats
  void* moe_scratch;
  void* xq;
  ExpertsFn experts;
  int64_t threads;
};

namespace {

struct Buffers {
  float *h, *hn, *a, *m, *mix, *lat, *y, *mlp, *mixer;
  localmoe_hybrid::Selection sel;  // the latest DSA selection of this token (MLA layers)
  float* blocks;  // attention residuals: stored blocks [nblocks, D]
};

// out = softmax_n(rsqrt(mean(V_n^2) + eps) (V_n . q)) . V over V = [blocks..., ps]
void depth_mix(const float* blocks, int64_t nb, const float* ps, const float* q, int64_t D, float eps, float* out) {
  float score[64];
  float mx = -INFINITY;
  for (int64_t n = 0; n <= nb; ++n) {
    const float* v = n < nb ? blocks + n * D : ps;
    score[n] = dot(v, q, D) / std::sqrt(dot(v, v, D) / static_cast<float>(D) + eps);
    mx = std::max(mx, score[n]);
  }
  float total = 0.0f;
  for (int64_t n = 0; n <= nb; ++n) total += (score[n] = std::exp(score[n] - mx));
  std::memset(out, 0, D * sizeof(float));
  for (int64_t n = 0; n <= nb; ++n) localmoe_hybrid::axpy(score[n] / total, n < nb ? blocks + n * D : ps, out, D);
}

// m [D] = the layer's MLP of hn [D].
int mlp(const HybridLayer& L, int64_t index, int64_t D, const float* hn, float* m, Buffers& b, ExpertsFn experts,
        int q8, int64_t* ids, float* weights, void* moe_scratch, void* xq, int threads) {
  std::memset(m, 0, D * sizeof(float));
  if (L.moe) {
    const int64_t W = L.lat_down.rows ? L.lat_down.rows : D;
    const float* ex = hn;
    if (L.lat_down.rows) {
      localmoe::matvec(L.lat_down, hn, b.lat, xq, threads);
      ex = b.lat;
    }
    float* y = L.lat_down.rows ? b.y : m;
    std::memset(y, 0, W * sizeof(float));
    if (L.table) {
      mxfp4_moe_routed(hn, D, L.router_w, L.router_b, L.correction, static_cast<int>(L.scoring),
                       static_cast<int>(L.renormalize), L.scaling, ex, 1, W, L.intermediate, L.top_k, L.table,
                       L.experts, static_cast<int>(L.expert_glu), L.p0, L.p1, y, ids, weights, moe_scratch, threads, q8);
    } else if (L.blocks) {  // the same routing; the chosen experts in increasing id, x rounded once for all
      float* logits = static_cast<float*>(moe_scratch);
      mxfp4_route(hn, D, L.router_w, L.router_b, L.correction, static_cast<int>(L.scoring),
                  static_cast<int>(L.renormalize), L.scaling, 1, L.top_k, L.experts, ids, weights, logits, threads);
      int64_t order[64], sorted[64];
      float chosen[64];
      for (int64_t j = 0; j < L.top_k; ++j) order[j] = j;
      std::sort(order, order + L.top_k, [&](int64_t a, int64_t c) { return ids[a] < ids[c]; });
      for (int64_t j = 0; j < L.top_k; ++j) sorted[j] = ids[order[j]], chosen[j] = weights[order[j]];
      if (ggml_moe_token(ex, W, L.intermediate, sorted, chosen, L.top_k, L.blocks, L.block_types,
                         static_cast<int>(L.expert_glu), L.p0, L.p1, y, logits + L.experts, threads) != 0)
        return 1;
    } else if (L.dense) {  // the callback's computation without the call: the same routing, experts, order
      float* logits = static_cast<float*>(moe_scratch);
      mxfp4_route(hn, D, L.router_w, L.router_b, L.correction, static_cast<int>(L.scoring),
                  static_cast<int>(L.renormalize), L.scaling, 1, L.top_k, L.experts, ids, weights, logits, threads);
      int64_t order[64], sorted[64];
      float chosen[64];
      for (int64_t j = 0; j < L.top_k; ++j) order[j] = j;
      std::sort(order, order + L.top_k, [&](int64_t a, int64_t c) { return ids[a] < ids[c]; });
      for (int64_t j = 0; j < L.top_k; ++j) sorted[j] = ids[order[j]], chosen[j] = weights[order[j]];
      dense_experts_token(ex, W, L.intermediate, sorted, chosen, L.top_k, L.dense, L.dense_type,
                          static_cast<int>(L.expert_glu), L.p0, L.p1, y, logits + L.experts, xq, threads);
    } else if (experts(index, 1, hn, ex, y) != 0) {
      return 1;
    }
    if (L.lat_down.rows) {
      rms_norm(y, L.lat_norm, W, L.lat_eps, y);
      localmoe::matvec(L.lat_up, y, m, xq, threads);
    }
  }
  if (L.gate_up.rows) {  // the dense MLP, or the shared experts added to the routed sum
    const int64_t I = L.gate_up.rows / 2;
    localmoe::matvec(L.gate_up, hn, b.mlp, xq, threads);
    localmoe::glu_rows(static_cast<int>(L.glu), b.mlp, b.mlp + I, I, L.glu_p0, L.glu_p1);
    float* s = b.mlp + 2 * I;
    localmoe::matvec(L.down, b.mlp, s, xq, threads);
    if (L.shared_gate) {
      const float gate = localmoe_hybrid::sigmoid(dot(L.shared_gate, hn, D));
      for (int64_t i = 0; i < D; ++i) s[i] = gate * s[i];
    }
    for (int64_t i = 0; i < D; ++i) m[i] += s[i];
  }
  return 0;
}

// One sublayer's hyper-connection weights from the streams X [N, D] (engine/layers/hyper_connections.py
// `HyperConnection.weights`): pre, post [N], comb [N, N] (row m, column n) Sinkhorn-normalised; out: (2 + N) N
// floats of scratch.
void hc_weights(const Matrix& fn, const float* base, const float* scale, int64_t N, int64_t D, float norm_eps,
                float hc_eps, int64_t iters, const float* X, float* z, float* pre, float* post, float* comb, float* out,
                void* xq, int threads) {
  const int64_t ND = N * D;
  const float r = 1.0f / std::sqrt(dot(X, X, ND) / static_cast<float>(ND) + norm_eps);
  for (int64_t i = 0; i < ND; ++i) z[i] = X[i] * r;
  localmoe::matvec(fn, z, out, xq, threads);
  for (int64_t n = 0; n < N; ++n) {
    pre[n] = localmoe_hybrid::sigmoid(out[n] * scale[0] + base[n]) + hc_eps;
    post[n] = 2.0f * localmoe_hybrid::sigmoid(out[N + n] * scale[1] + base[N + n]);
  }
  for (int64_t m = 0; m < N; ++m) {  // softmax over each row, plus the floor
    float* c = comb + m * N;
    float mx = -INFINITY, total = 0.0f;
    for (int64_t n = 0; n < N; ++n) mx = std::max(mx, c[n] = out[2 * N + m * N + n] * scale[2] + base[2 * N + m * N + n]);
    for (int64_t n = 0; n < N; ++n) total += (c[n] = std::exp(c[n] - mx));
    for (int64_t n = 0; n < N; ++n) c[n] = c[n] / total + hc_eps;
  }
  auto columns = [&] {
    for (int64_t n = 0; n < N; ++n) {
      float total = 0.0f;
      for (int64_t m = 0; m < N; ++m) total += comb[m * N + n];
      for (int64_t m = 0; m < N; ++m) comb[m * N + n] /= total + hc_eps;
    }
  };
  columns();
  for (int64_t it = 1; it < iters; ++it) {
    for (int64_t m = 0; m < N; ++m) {
      float total = 0.0f;
      for (int64_t n = 0; n < N; ++n) total += comb[m * N + n];
      for (int64_t n = 0; n < N; ++n) comb[m * N + n] /= total + hc_eps;
    }
    columns();
  }
}

// h [D] = sum_n pre[n] X[n]; after the sublayer's y [D]: X[n] <- post[n] y + sum_m comb[m, n] X[m] (old X).
void hc_collapse(const float* X, const float* pre, int64_t N, int64_t D, float* h) {
  for (int64_t d = 0; d < D; ++d) {
    float s = 0.0f;
    for (int64_t n = 0; n < N; ++n) s += pre[n] * X[n * D + d];
    h[d] = s;
  }
}

void hc_spread(float* X, float* old, const float* y, const float* post, const float* comb, int64_t N, int64_t D) {
  std::memcpy(old, X, N * D * sizeof(float));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t d = 0; d < D; ++d) {
      float s = 0.0f;
      for (int64_t m = 0; m < N; ++m) s += comb[m * N + n] * old[m * D + d];
      X[n * D + d] = post[n] * y[d] + s;
    }
}

int64_t gqa_scratch(const Gqa& g) {
  return localmoe_gqa::step_scratch(g.heads, g.kv_heads, g.head_dim) + g.gate.rows;
}

// out [H D] = attention(rope(norm(qkv x))) * sigmoid(gate x); K/V written at `pos`.
void gqa_mixer(const Gqa& g, const float* x, int64_t pos, const float* cos, const float* ssin, float* out,
               float* scratch, void* xq, int threads) {
  const int64_t H = g.heads, Hkv = g.kv_heads, D = g.head_dim;
  const Matrix none{nullptr, localmoe::kF32, 0, H * D, nullptr};  // the attention output stays in scratch
  const int64_t first = g.window ? std::max<int64_t>(0, pos + 1 - g.window) : 0;
  if (g.keys.pool != nullptr)
    localmoe_gqa::attention_step_cached(x, g.qkv, none, H, Hkv, D, g.rot, cos, ssin, g.keys, g.values, pos, first,
                                        g.sinks, g.scale, g.q_norm, g.k_norm, g.eps, out, scratch, xq, threads);
  else
    localmoe_gqa::attention_step(x, g.qkv, none, H, Hkv, D, g.rot, cos, ssin, g.kpool, g.vpool, g.head_stride, pos,
                                 first, g.sinks, g.scale, g.q_norm, g.k_norm, g.eps, out, scratch, xq, threads);
  const float* attn = scratch + (H + 2 * Hkv) * D;
  std::memcpy(out, attn, H * D * sizeof(float));
  if (g.gate.rows) {
    float* gate = scratch + localmoe_gqa::step_scratch(H, Hkv, D);
    localmoe::matvec(g.gate, x, gate, xq, threads);
    for (int64_t i = 0; i < H * D; ++i) out[i] *= localmoe_hybrid::sigmoid(gate[i]);
  }
}

// The mixer's output width (the o_proj input).
int64_t mixer_width(const HybridLayer& L) {
  switch (L.mixer) {
    case 0: return L.kda.heads * L.kda.head_dim;
    case 1: return L.mla.heads * L.mla.vdim;
    case 2: return L.gdn.value_heads * L.gdn.value_dim;
    default: return L.gqa.heads * L.gqa.head_dim;
  }
}

// Floats of scratch the layer's mixer needs past its output (the decode step's and the rows' workspaces).
int64_t mixer_scratch(const HybridLayer& L) {
  switch (L.mixer) {
    case 0: return localmoe_hybrid::kda_scratch(L.kda);
    case 1: return localmoe_hybrid::mla_scratch(L.mla);
    case 2: return localmoe_hybrid::gdn_scratch(L.gdn);
    default: return gqa_scratch(L.gqa);
  }
}

// The mixer of hn [D] -> b.mixer [mixer_width] (before the output projection).
void mixer_core(const HybridLayer& L, const float* hn, int64_t pos, const float* cos, const float* ssin, Buffers& b,
                void* xq, int threads) {
  float* scratch = b.mixer + mixer_width(L);
  switch (L.mixer) {
    case 0: localmoe_hybrid::kda_step(L.kda, hn, b.mixer, scratch, xq, threads); break;
    case 1: localmoe_hybrid::mla_step(L.mla, hn, pos, cos, ssin, b.mixer, scratch, b.sel, xq, threads); break;
    case 2: localmoe_hybrid::gdn_step(L.gdn, hn, b.mixer, scratch, xq, threads); break;
    default: gqa_mixer(L.gqa, hn, pos, cos, ssin, b.mixer, scratch, xq, threads);
  }
}

void mixer(const HybridLayer& L, const float* hn, int64_t pos, const float* cos, const float* ssin, float* a,
           Buffers& b, void* xq, int threads) {
  mixer_core(L, hn, pos, cos, ssin, b, xq, threads);
  localmoe::matvec(L.o_proj, b.mixer, a, xq, threads);
}

}  // namespace

extern "C" {

// out [W] += weight * down(glu(gate x, up x)): one routed expert with dense matrices (fp32, bf16, GGUF
// blocks) for one token, as the engine calls it from the experts callback (every provider the same code,
// so paged and resident experts give the same bits); scratch: 2 I + W floats, xq: matvec scratch.
void dense_expert(const float* x, const Matrix* gate, const Matrix* up, const Matrix* down, int glu, float p0, float p1,
                  float weight, float* out, float* scratch, void* xq, int threads) {
  const int64_t I = gate->rows, W = down->rows;
  float *g = scratch, *u = scratch + I, *y = scratch + 2 * I;
  localmoe::matvec(*gate, x, g, xq, threads);
  localmoe::matvec(*up, x, u, xq, threads);
  localmoe::glu_rows(glu, g, u, I, p0, p1);
  localmoe::matvec(*down, g, y, xq, threads);
  for (int64_t i = 0; i < W; ++i) out[i] += weight * y[i];
}

// out [W] += the weighted routed experts ids[0..k) of one token x [W] (added in that order), each with dense
// matrices (`type`: fp32, bf16) at table[3 e], table[3 e + 1], table[3 e + 2] (gate [I, W], up [I, W], down [W, I]):
// one `dense_expert` each. The fused step's resident dense experts run through it, and so do a pager's held
// ones (engine/decode_plan.py, kernels/mxfp4_moe/held.py): the same bits. scratch 2 I + W floats.
void dense_experts_token(const float* x, int64_t W, int64_t I, const int64_t* ids, const float* weights, int64_t k,
                         const int64_t* table, int64_t type, int glu, float p0, float p1, float* out, float* scratch,
                         void* xq, int threads) {
  for (int64_t j = 0; j < k; ++j) {
    const int64_t* w = table + 3 * ids[j];
    const Matrix gate{reinterpret_cast<const void*>(w[0]), type, I, W, nullptr};
    const Matrix up{reinterpret_cast<const void*>(w[1]), type, I, W, nullptr};
    const Matrix down{reinterpret_cast<const void*>(w[2]), type, W, I, nullptr};
    dense_expert(x, &gate, &up, &down, glu, p0, p1, weights[j], out, scratch, xq, threads);
  }
}

// Floats of `scratch` decode_hybrid needs for these layers (the MoE kernel's scratch and xq are apart).
int64_t decode_hybrid_scratch(const HybridLayer* layers, int64_t n, int64_t D, int64_t block_size) {
  int64_t widest = 0;
  for (int64_t l = 0; l < n; ++l) {
    const HybridLayer& L = layers[l];
    const int64_t mix = mixer_width(L) + mixer_scratch(L);
    widest = std::max(widest, std::max(mix, L.gate_up.rows + D) + 3 * L.lat_down.rows);
  }
  const int64_t blocks = block_size ? n / block_size + 2 : 0;
  return 64 + (6 + blocks) * D + widest;
}

}  // extern "C"

namespace {

// decode_hybrid's layers: x [D] -> h [D], the final-normed hidden state.
int hybrid_layers(const HybridLayer* layers, int64_t n, float* x, int64_t D, int64_t pos, const float* cos,
                  const float* ssin, int64_t block_size, const float* output_query, const float* final_norm, float eps,
                  int q8, float* h, int64_t* ids, float* weights, float* scratch, void* moe_scratch, void* xq,
                  ExpertsFn experts, int threads) {
  Buffers b{};
  float* p = scratch;
  for (float** f : {&b.hn, &b.a, &b.m, &b.mix}) *f = p, p += D;
  b.blocks = p;
  p += block_size ? (n / block_size + 2) * D : 0;
  int64_t L0 = 0;  // the widest latent MoE
  for (int64_t l = 0; l < n; ++l) L0 = std::max(L0, layers[l].lat_down.rows);
  b.lat = p;
  b.y = b.lat + L0;
  b.mlp = b.y + L0;
  b.mixer = b.mlp;  // the mixer and the MLP never need their scratch at the same time
  int64_t picks = 1;  // the widest DSA selection: top_k (+ a k-pool tail)
  for (int64_t l = 0; l < n; ++l) picks = std::max(picks, layers[l].mla.dsa.top_k + layers[l].mla.dsa.pool);
  thread_local std::vector<int64_t> selected;
  selected.resize(picks);
  b.sel = {selected.data(), 0, 0};
  if (layers[0].hc_mult) {  // hyper-connections: N streams, each sublayer between a collapse and a spread
    const int64_t N = layers[0].hc_mult, iters = layers[0].hc_iters;
    const float hc_eps = layers[0].hc_eps;
    thread_local std::vector<float> streams;  // X, old, z [N, D]; pre, post [N], comb [N, N], the fn output (2 + N) N
    streams.resize(3 * N * D + (5 + 2 * N) * N);
    float *X = streams.data(), *old = X + N * D, *z = old + N * D;
    float *pre = z + N * D, *post = pre + N, *comb = post + N, *out = comb + N * N;
    for (int64_t k = 0; k < N; ++k) std::memcpy(X + k * D, x, D * sizeof(float));
    for (int64_t l = 0; l < n; ++l) {
      const HybridLayer& L = layers[l];
      hc_weights(L.hc_attn, L.hc_attn_base, L.hc_attn_scale, N, D, eps, hc_eps, iters, X, z, pre, post, comb, out,
                 xq, threads);
      hc_collapse(X, pre, N, D, b.mix);
      rms_norm(b.mix, L.attn_norm, D, eps, b.hn);
      mixer(L, b.hn, pos, cos, ssin, b.a, b, xq, threads);
      hc_spread(X, old, b.a, post, comb, N, D);
      hc_weights(L.hc_ffn, L.hc_ffn_base, L.hc_ffn_scale, N, D, eps, hc_eps, iters, X, z, pre, post, comb, out,
                 xq, threads);
      hc_collapse(X, pre, N, D, b.mix);
      rms_norm(b.mix, L.mlp_norm, D, eps, b.hn);
      if (mlp(L, l, D, b.hn, b.m, b, experts, q8, ids, weights, moe_scratch, xq, threads)) return 1;
      hc_spread(X, old, b.m, post, comb, N, D);
    }
    for (int64_t d = 0; d < D; ++d) {  // the streams' mean
      float s = 0.0f;
      for (int64_t k = 0; k < N; ++k) s += X[k * D + d];
      b.mix[d] = s / static_cast<float>(N);
    }
    rms_norm(b.mix, final_norm, D, eps, h);
    return 0;
  }
  if (!block_size) {
    rms_norm(x, layers[0].attn_norm, D, eps, b.hn);
    for (int64_t l = 0; l < n; ++l) {
      const HybridLayer& L = layers[l];
      mixer(L, b.hn, pos, cos, ssin, b.a, b, xq, threads);
      for (int64_t i = 0; i < D; ++i) x[i] += b.a[i];
      rms_norm(x, L.mlp_norm, D, eps, b.hn);
      if (mlp(L, l, D, b.hn, b.m, b, experts, q8, ids, weights, moe_scratch, xq, threads)) return 1;
      for (int64_t i = 0; i < D; ++i) x[i] += b.m[i];
      rms_norm(x, l + 1 < n ? layers[l + 1].attn_norm : final_norm, D, eps, l + 1 < n ? b.hn : h);
    }
    return 0;
  }
  float* ps = x;  // the running partial sum of the current block
  int64_t nb = 0;
  for (int64_t l = 0; l < n; ++l) {
    const HybridLayer& L = layers[l];
    const float* in = ps;
    if (nb) {
      depth_mix(b.blocks, nb, ps, L.attn_query, D, eps, b.mix);
      in = b.mix;
    }
    const bool restart = l % block_size == 0;
    rms_norm(in, L.attn_norm, D, eps, b.hn);
    if (restart) std::memcpy(b.blocks + nb++ * D, ps, D * sizeof(float));
    mixer(L, b.hn, pos, cos, ssin, b.a, b, xq, threads);
    for (int64_t i = 0; i < D; ++i) ps[i] = restart ? b.a[i] : ps[i] + b.a[i];
    depth_mix(b.blocks, nb, ps, L.mlp_query, D, eps, b.mix);
    rms_norm(b.mix, L.mlp_norm, D, eps, b.hn);
    if (mlp(L, l, D, b.hn, b.m, b, experts, q8, ids, weights, moe_scratch, xq, threads)) return 1;
    for (int64_t i = 0; i < D; ++i) ps[i] += b.m[i];
  }
  depth_mix(b.blocks, nb, ps, output_query, D, eps, b.mix);
  rms_norm(b.mix, final_norm, D, eps, h);
  return 0;
}

}  // namespace

extern "C" {

// One decode token of one sequence through every layer (c->x [D]: the embedded token, overwritten) -> c->h [D], the
// final-normed hidden state, and where `head` is given (the lm_head [V, D]: in this call, so a decode step is one
// call from the embedding to the logits) logits [V] = head h; cos / ssin: the RoPE tables at the token's rotary
// position for GQA and rotating MLA layers (null without any). block_size 0: plain residuals (or, where layer 0's
// hc_mult is set, hyper-connections), else attention residuals with queries per layer and `output_query`. xq:
// matvec scratch for the widest input (the head's too). Returns 0, or 1 where the experts callback asked to stop
// or ggml_moe_token refused a layer's experts (h and logits are then undefined).
int decode_hybrid(const HybridCall* c) {
  const int threads = static_cast<int>(c->threads);
  if (hybrid_layers(c->layers, c->n, c->x, c->D, c->pos, c->cos, c->ssin, c->block_size, c->output_query,
                    c->final_norm, c->eps, static_cast<int>(c->q8), c->h, c->ids, c->weights, c->scratch,
                    c->moe_scratch, c->xq, c->experts, threads) != 0)
    return 1;
  if (c->head != nullptr) localmoe::matvec(*c->head, c->h, c->logits, c->xq, threads);
  return 0;
}

}  // extern "C"

// ---- the rows form: N rows in one call, each with the bits decode_hybrid gives its token alone ----

namespace {

// A recurrent layer's state and conv tail and their sizes in floats (0: not a delta-rule layer).
int64_t recurrent(const HybridLayer& L, float** state, float** tail, int64_t* tail_floats) {
  if (L.mixer == 0) {
    const int64_t H = L.kda.heads, K = L.kda.head_dim;
    *state = L.kda.state, *tail = L.kda.tail, *tail_floats = (L.kda.conv_kernel - 1) * 3 * H * K;
    return H * K * K;
  }
  if (L.mixer == 2) {
    const localmoe_hybrid::Gdn& g = L.gdn;
    *state = g.state, *tail = g.tail;
    *tail_floats = (g.conv_kernel - 1) * (2 * g.key_heads * g.key_dim + g.value_heads * g.value_dim);
    return g.value_heads * g.key_dim * g.value_dim;
  }
  return 0;
}

// Row `to`'s delta-rule state and conv tail start as copies of row `from`'s (a verify that keeps the state after
// each of its rows: engine/state_cache.py `record`).
void carry_state(const HybridLayer& from, const HybridLayer& to) {
  float *fs, *ft, *ts, *tt;
  int64_t ftail, ttail;
  const int64_t floats = recurrent(from, &fs, &ft, &ftail);
  if (floats == 0 || recurrent(to, &ts, &tt, &ttail) != floats || fs == ts) return;
  std::memcpy(ts, fs, floats * sizeof(float));
  std::memcpy(tt, ft, ftail * sizeof(float));
}

// y [N, W] += the routed dense experts of the rows x [N, W] (ids / weights [N, k], each row's in increasing id),
// expert by expert in increasing id over the rows routed to it (`matrows`: every row gets the bits `matvec` gives
// it), each row's experts added in increasing id with dense_expert's expression: a row's bits are those
// dense_experts_token gives it alone, and each expert is read once for all its rows. gx, gy [N, W], gu [2 N, I].
void dense_experts_rows(const float* x, int64_t N, int64_t W, int64_t I, const int64_t* ids, const float* weights,
                        int64_t k, const int64_t* table, int64_t type, int glu, float p0, float p1, float* out,
                        float* gx, float* gu, float* gy, void* xq, int threads) {
  thread_local std::vector<int64_t> order;
  order.resize(N * k);
  for (int64_t i = 0; i < N * k; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[a] != ids[b] ? ids[a] < ids[b] : a < b; });
  for (int64_t a = 0; a < N * k;) {
    const int64_t e = ids[order[a]];
    int64_t b = a;
    while (b < N * k && ids[order[b]] == e) ++b;
    const int64_t n = b - a;
    for (int64_t j = 0; j < n; ++j) std::memcpy(gx + j * W, x + (order[a + j] / k) * W, W * sizeof(float));
    const int64_t* w = table + 3 * e;
    const Matrix gate{reinterpret_cast<const void*>(w[0]), type, I, W, nullptr};
    const Matrix up{reinterpret_cast<const void*>(w[1]), type, I, W, nullptr};
    const Matrix down{reinterpret_cast<const void*>(w[2]), type, W, I, nullptr};
    float *g = gu, *u = gu + n * I;
    localmoe::matrows(gate, gx, n, g, xq, threads);
    localmoe::matrows(up, gx, n, u, xq, threads);
    for (int64_t j = 0; j < n; ++j) localmoe::glu_rows(glu, g + j * I, u + j * I, I, p0, p1);
    localmoe::matrows(down, g, n, gy, xq, threads);
    for (int64_t j = 0; j < n; ++j) {
      float* o = out + (order[a + j] / k) * W;
      const float weight = weights[order[a + j]];
      const float* y = gy + j * W;
      for (int64_t i = 0; i < W; ++i) o[i] += weight * y[i];
    }
    a = b;
  }
}

// GQA mixers of N rows (gqa_mixer's arithmetic per row): the q/k/v and gate matrices once for all rows (`matrows`:
// each row gets matvec's bits), then row by row in row order the q/k norms and RoPE as project_qkv, the cache write
// and attention as attention_step (`attend_pools`, `attend_cached`) and the gate -> out [N, H D]. qkv, gate:
// [N, rows] scratch; g(r): row r's layer (its caches).
template <class RowGqa>
void gqa_rows(const Gqa& g0, int64_t, int64_t N, const float* hn, float* qkv, float* gate, RowGqa g, const int64_t* pos,
              const float* cos, const float* ssin, int64_t rope_stride, float* out, void* xq, int threads) {
  const int64_t H = g0.heads, Hkv = g0.kv_heads, D = g0.head_dim, width = g0.qkv.rows, HD = H * D;
  localmoe::matrows(g0.qkv, hn, N, qkv, xq, threads);
  if (g0.gate.rows) localmoe::matrows(g0.gate, hn, N, gate, xq, threads);
  for (int64_t r = 0; r < N; ++r) {
    const Gqa& L = g(r);
    float* q = qkv + r * width;
    if (L.q_norm != nullptr)
      for (int64_t h = 0; h < H + Hkv; ++h) localmoe_gqa::head_rms_norm(q + h * D, D, h < H ? L.q_norm : L.k_norm, L.eps);
    for (int64_t h = 0; h < H + Hkv; ++h)
      localmoe_gqa::rope(q + h * D, L.rot, cos + r * rope_stride, ssin + r * rope_stride);
    const int64_t first = L.window ? std::max<int64_t>(0, pos[r] + 1 - L.window) : 0;
    float* o = out + r * HD;
    if (L.keys.pool != nullptr)
      localmoe_gqa::attend_cached(q, H, Hkv, D, L.keys, L.values, pos[r], first, L.sinks, L.scale, o, threads);
    else
      localmoe_gqa::attend_pools(q, H, Hkv, D, L.kpool, L.vpool, L.head_stride, pos[r], first, L.sinks, L.scale, o,
                                 threads);
    if (g0.gate.rows)
      for (int64_t i = 0; i < HD; ++i) o[i] *= localmoe_hybrid::sigmoid(gate[r * HD + i]);
  }
}

// decode_hybrid_rows' buffers (floats, rows stacked): the normed inputs, mixer and MLP outputs, each row's mixer
// scratch, attention-residual blocks and hyper-connection streams, the MLP's row matrices.
struct Rows {
  int64_t N, D, mix, width, blocks, streams, qkv, gate;
  float *hn, *a, *m, *mix_in, *out, *region, *block, *stream, *lat, *y, *mlp, *s, *gx, *gu, *gy, *gq, *gg;
};

Rows rows_buffers(const HybridLayer* layers, int64_t n, int64_t N, int64_t D, int64_t block_size,
                  std::vector<float>& work) {
  Rows w{};
  w.N = N, w.D = D;
  int64_t lat = 0, inner = 0, ewidth = D, einner = 0;
  for (int64_t l = 0; l < n; ++l) {
    const HybridLayer& L = layers[l];
    w.mix = std::max(w.mix, mixer_width(L) + mixer_scratch(L));
    w.width = std::max(w.width, mixer_width(L));
    lat = std::max(lat, L.lat_down.rows);
    inner = std::max(inner, L.gate_up.rows);
    ewidth = std::max(ewidth, L.lat_down.rows);
    if (L.dense) einner = std::max(einner, L.intermediate);
    if (L.mixer == 3) w.qkv = std::max(w.qkv, L.gqa.qkv.rows), w.gate = std::max(w.gate, L.gqa.gate.rows);
  }
  w.blocks = block_size ? (n / block_size + 2) * D : 0;
  const int64_t hc = layers[0].hc_mult;
  w.streams = hc ? 3 * hc * D + (5 + 2 * hc) * hc : 0;
  const int64_t floats = N * (5 * D + w.width + w.mix + w.blocks + w.streams + 2 * lat + inner + 2 * ewidth +
                              2 * einner + w.qkv + w.gate) + 64;
  if (static_cast<int64_t>(work.size()) < floats) work.resize(floats);
  float* p = work.data();
  for (float** f : {&w.hn, &w.a, &w.m, &w.mix_in, &w.s}) *f = p, p += N * D;
  w.out = p, p += N * w.width;
  w.region = p, p += N * w.mix;
  w.block = p, p += N * w.blocks;
  w.stream = p, p += N * w.streams;
  w.lat = p, p += N * lat;
  w.y = p, p += N * lat;
  w.mlp = p, p += N * inner;
  w.gx = p, p += N * ewidth;
  w.gy = p, p += N * ewidth;
  w.gq = p, p += N * w.qkv;
  w.gg = p, p += N * w.gate;
  w.gu = p;
  return w;
}

// The MLP of the rows hn [N, D] -> m [N, D]: each matrix read once for all rows (`matrows`), routing, norms and the
// gate per row, the routed experts as mlp() runs them for one row (a resident MXFP4 table in slices of `slice` rows,
// every expert group on its one-token path; dense experts expert by expert over their rows; GGUF-block experts per
// row; the callback once for all rows): every row's bits are mlp()'s for it alone.
int mlp_rows(const HybridLayer& L, int64_t index, int64_t N, int64_t D, const float* hn, float* m, Rows& w,
             ExpertsFn experts, int q8, int64_t slice, void* xq, int threads) {
  std::memset(m, 0, N * D * sizeof(float));
  if (L.moe) {
    const int64_t W = L.lat_down.rows ? L.lat_down.rows : D, k = L.top_k, E = L.experts;
    const float* ex = hn;
    if (L.lat_down.rows) {
      localmoe::matrows(L.lat_down, hn, N, w.lat, xq, threads);
      ex = w.lat;
    }
    float* y = L.lat_down.rows ? w.y : m;
    std::memset(y, 0, N * W * sizeof(float));
    thread_local std::vector<int64_t> ids;
    thread_local std::vector<float> weights, logits;
    thread_local std::vector<uint64_t> moe;
    ids.resize(N * std::max<int64_t>(k, 1));
    weights.resize(N * std::max<int64_t>(k, 1));
    if (L.table) {
      const int64_t rows = std::min(N, slice);
      const int64_t bytes = mxfp4_moe_routed_scratch(rows, k, W, L.intermediate, E);
      if (static_cast<int64_t>(moe.size() * 8) < bytes) moe.resize(bytes / 8 + 1);
      for (int64_t r = 0; r < N; r += slice) {
        const int64_t n = std::min(slice, N - r);
        mxfp4_moe_routed(hn + r * D, D, L.router_w, L.router_b, L.correction, static_cast<int>(L.scoring),
                         static_cast<int>(L.renormalize), L.scaling, ex + r * W, n, W, L.intermediate, k, L.table, E,
                         static_cast<int>(L.expert_glu), L.p0, L.p1, y + r * W, ids.data(), weights.data(),
                         moe.data(), threads, q8);
      }
    } else if (L.blocks || L.dense) {  // routing per row as mlp(), each row's experts in increasing id
      logits.resize(E);
      for (int64_t r = 0; r < N; ++r) {
        int64_t* id = ids.data() + r * k;
        float* wt = weights.data() + r * k;
        mxfp4_route(hn + r * D, D, L.router_w, L.router_b, L.correction, static_cast<int>(L.scoring),
                    static_cast<int>(L.renormalize), L.scaling, 1, k, E, id, wt, logits.data(), threads);
        int64_t order[64], sorted[64];
        float chosen[64];
        for (int64_t j = 0; j < k; ++j) order[j] = j;
        std::sort(order, order + k, [&](int64_t a, int64_t c) { return id[a] < id[c]; });
        for (int64_t j = 0; j < k; ++j) sorted[j] = id[order[j]], chosen[j] = wt[order[j]];
        std::memcpy(id, sorted, k * sizeof(int64_t));
        std::memcpy(wt, chosen, k * sizeof(float));
      }
      if (L.blocks) {
        const int64_t bytes = ggml_moe_token_scratch(k, W, L.intermediate) + 64;
        if (static_cast<int64_t>(moe.size() * 8) < bytes) moe.resize(bytes / 8 + 1);
        for (int64_t r = 0; r < N; ++r)
          if (ggml_moe_token(ex + r * W, W, L.intermediate, ids.data() + r * k, weights.data() + r * k, k, L.blocks,
                             L.block_types, static_cast<int>(L.expert_glu), L.p0, L.p1, y + r * W, moe.data(),
                             threads) != 0)
            return 1;
      } else {
        dense_experts_rows(ex, N, W, L.intermediate, ids.data(), weights.data(), k, L.dense, L.dense_type,
                           static_cast<int>(L.expert_glu), L.p0, L.p1, y, w.gx, w.gu, w.gy, xq, threads);
      }
    } else if (experts(index, N, hn, ex, y) != 0) {
      return 1;
    }
    if (L.lat_down.rows) {
      for (int64_t r = 0; r < N; ++r) rms_norm(y + r * W, L.lat_norm, W, L.lat_eps, y + r * W);
      localmoe::matrows(L.lat_up, y, N, m, xq, threads);
    }
  }
  if (L.gate_up.rows) {  // the dense MLP, or the shared experts added to the routed sum
    const int64_t I = L.gate_up.rows / 2;
    localmoe::matrows(L.gate_up, hn, N, w.mlp, xq, threads);
    for (int64_t r = 0; r < N; ++r) {  // glu(gate, up) packed as [N, I] over the rows consumed already
      localmoe::glu_rows(static_cast<int>(L.glu), w.mlp + r * 2 * I, w.mlp + r * 2 * I + I, I, L.glu_p0, L.glu_p1);
      if (r > 0) std::memmove(w.mlp + r * I, w.mlp + r * 2 * I, I * sizeof(float));
    }
    localmoe::matrows(L.down, w.mlp, N, w.s, xq, threads);
    for (int64_t r = 0; r < N; ++r) {
      float* s = w.s + r * D;
      if (L.shared_gate) {
        const float gate = localmoe_hybrid::sigmoid(dot(L.shared_gate, hn + r * D, D));
        for (int64_t i = 0; i < D; ++i) s[i] = gate * s[i];
      }
      float* mr = m + r * D;
      for (int64_t i = 0; i < D; ++i) mr[i] += s[i];
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// decode_hybrid for N rows (N sequences' tokens, or consecutive tokens of one sequence: a speculative verify), as
// engine/batch.py forward_rows lays them out: c->x [N, D] (updated) -> c->h [N, D]; sets[r]: the address of row r's
// HybridLayer array (the model's layers bound to that row's caches; the rows of one sequence share one, or, where a
// verify keeps each row's delta-rule state, carry[r] names the row whose state row r starts from: -1 none); pos [N]
// the rows' cache positions; c->cos / c->ssin [N, rope_stride] their RoPE tables (or null); slice: the most rows of
// one resident MXFP4 MoE call that keep each row's one-token path (kernels/mxfp4_moe EXACT_TOKEN_ROWS); c->xq:
// matrows scratch for N rows of the widest input. Per layer the mixers run row by row in row order (a row sees the
// cache rows and states the rows before it wrote), the output projection, norms, residual schemes and MLPs over all
// rows with every row's arithmetic exactly decode_hybrid's: each row has the bits decode_hybrid gives its token
// alone, whatever the other rows. c->head is not applied. Returns 0, or 1 as decode_hybrid.
int decode_hybrid_rows(const HybridCall* c, const int64_t* sets, int64_t N, const int64_t* pos, int64_t rope_stride,
                       const int64_t* carry, int64_t slice) {
  const int64_t n = c->n, D = c->D;
  const int threads = static_cast<int>(c->threads), q8 = static_cast<int>(c->q8);
  const float eps = c->eps;
  void* xq = c->xq;
  auto layer = [&](int64_t r, int64_t l) -> const HybridLayer& {
    return reinterpret_cast<const HybridLayer*>(sets[r])[l];
  };
  const HybridLayer* layers = reinterpret_cast<const HybridLayer*>(sets[0]);
  thread_local std::vector<float> work;
  Rows w = rows_buffers(layers, n, N, D, c->block_size, work);
  int64_t picks = 1;  // the widest DSA selection: top_k (+ a k-pool tail)
  for (int64_t l = 0; l < n; ++l) picks = std::max(picks, layers[l].mla.dsa.top_k + layers[l].mla.dsa.pool);
  thread_local std::vector<int64_t> selected;
  selected.resize(N * picks);
  std::vector<Buffers> b(N);
  for (int64_t r = 0; r < N; ++r) {
    b[r].hn = w.hn + r * D, b[r].a = w.a + r * D, b[r].m = w.m + r * D, b[r].mix = w.mix_in + r * D;
    b[r].mixer = w.region + r * w.mix;
    b[r].blocks = w.block + r * w.blocks;
    b[r].sel = {selected.data() + r * picks, 0, 0};
  }
  float *x = c->x, *h = c->h;
  auto rope = [&](const float* t, int64_t r) { return t == nullptr ? nullptr : t + r * rope_stride; };
  auto mixers = [&](int64_t l) {  // a [N, D] = o_proj(each row's mixer, in row order)
    const int64_t width = mixer_width(layers[l]);
    if (layers[l].mixer == 3) {
      gqa_rows(layers[l].gqa, l, N, w.hn, w.gq, w.gg, [&](int64_t r) -> const Gqa& { return layer(r, l).gqa; }, pos,
               c->cos, c->ssin, rope_stride, w.out, xq, threads);
      localmoe::matrows(layers[l].o_proj, w.out, N, w.a, xq, threads);
      return;
    }
    for (int64_t r = 0; r < N; ++r) {
      const HybridLayer& L = layer(r, l);
      if (carry != nullptr && carry[r] >= 0) carry_state(layer(carry[r], l), L);
      mixer_core(L, w.hn + r * D, pos[r], rope(c->cos, r), rope(c->ssin, r), b[r], xq, threads);
      std::memcpy(w.out + r * width, b[r].mixer, width * sizeof(float));
    }
    localmoe::matrows(layers[l].o_proj, w.out, N, w.a, xq, threads);
  };
  auto mlps = [&](int64_t l) {
    return mlp_rows(layers[l], l, N, D, w.hn, w.m, w, c->experts, q8, slice, xq, threads);
  };
  if (layers[0].hc_mult) {  // hyper-connections: each row's streams, as hybrid_layers
    const int64_t S = layers[0].hc_mult, iters = layers[0].hc_iters;
    const float hc_eps = layers[0].hc_eps;
    auto streams = [&](int64_t r) { return w.stream + r * w.streams; };
    for (int64_t r = 0; r < N; ++r)
      for (int64_t k = 0; k < S; ++k) std::memcpy(streams(r) + k * D, x + r * D, D * sizeof(float));
    for (int64_t l = 0; l < n; ++l) {
      const HybridLayer& L = layers[l];
      for (int64_t r = 0; r < N; ++r) {
        float *X = streams(r), *old = X + S * D, *z = old + S * D;
        float *pre = z + S * D, *post = pre + S, *comb = post + S, *out = comb + S * S;
        hc_weights(L.hc_attn, L.hc_attn_base, L.hc_attn_scale, S, D, eps, hc_eps, iters, X, z, pre, post, comb, out,
                   xq, threads);
        hc_collapse(X, pre, S, D, b[r].mix);
        rms_norm(b[r].mix, L.attn_norm, D, eps, b[r].hn);
      }
      mixers(l);
      for (int64_t r = 0; r < N; ++r) {
        float *X = streams(r), *old = X + S * D, *z = old + S * D;
        float *pre = z + S * D, *post = pre + S, *comb = post + S, *out = comb + S * S;
        hc_spread(X, old, b[r].a, post, comb, S, D);
        hc_weights(L.hc_ffn, L.hc_ffn_base, L.hc_ffn_scale, S, D, eps, hc_eps, iters, X, z, pre, post, comb, out,
                   xq, threads);
        hc_collapse(X, pre, S, D, b[r].mix);
        rms_norm(b[r].mix, L.mlp_norm, D, eps, b[r].hn);
      }
      if (mlps(l)) return 1;
      for (int64_t r = 0; r < N; ++r) {
        float *X = streams(r), *old = X + S * D, *z = old + S * D;
        float *pre = z + S * D, *post = pre + S, *comb = post + S;
        hc_spread(X, old, b[r].m, post, comb, S, D);
      }
    }
    for (int64_t r = 0; r < N; ++r) {
      const float* X = streams(r);
      for (int64_t d = 0; d < D; ++d) {  // the streams' mean
        float s = 0.0f;
        for (int64_t k = 0; k < S; ++k) s += X[k * D + d];
        b[r].mix[d] = s / static_cast<float>(S);
      }
      rms_norm(b[r].mix, c->final_norm, D, eps, h + r * D);
    }
    return 0;
  }
  if (!c->block_size) {
    for (int64_t r = 0; r < N; ++r) rms_norm(x + r * D, layers[0].attn_norm, D, eps, b[r].hn);
    for (int64_t l = 0; l < n; ++l) {
      const HybridLayer& L = layers[l];
      mixers(l);
      for (int64_t r = 0; r < N; ++r) {
        float* xr = x + r * D;
        for (int64_t i = 0; i < D; ++i) xr[i] += b[r].a[i];
        rms_norm(xr, L.mlp_norm, D, eps, b[r].hn);
      }
      if (mlps(l)) return 1;
      for (int64_t r = 0; r < N; ++r) {
        float* xr = x + r * D;
        for (int64_t i = 0; i < D; ++i) xr[i] += b[r].m[i];
        rms_norm(xr, l + 1 < n ? layers[l + 1].attn_norm : c->final_norm, D, eps, l + 1 < n ? b[r].hn : h + r * D);
      }
    }
    return 0;
  }
  int64_t nb = 0;  // attention residuals: each row's partial sum ps (its x) and stored blocks
  for (int64_t l = 0; l < n; ++l) {
    const HybridLayer& L = layers[l];
    const bool restart = l % c->block_size == 0;
    for (int64_t r = 0; r < N; ++r) {
      float* ps = x + r * D;
      const float* in = ps;
      if (nb) {
        depth_mix(b[r].blocks, nb, ps, L.attn_query, D, eps, b[r].mix);
        in = b[r].mix;
      }
      rms_norm(in, L.attn_norm, D, eps, b[r].hn);
      if (restart) std::memcpy(b[r].blocks + nb * D, ps, D * sizeof(float));
    }
    nb += restart;
    mixers(l);
    for (int64_t r = 0; r < N; ++r) {
      float* ps = x + r * D;
      for (int64_t i = 0; i < D; ++i) ps[i] = restart ? b[r].a[i] : ps[i] + b[r].a[i];
      depth_mix(b[r].blocks, nb, ps, L.mlp_query, D, eps, b[r].mix);
      rms_norm(b[r].mix, L.mlp_norm, D, eps, b[r].hn);
    }
    if (mlps(l)) return 1;
    for (int64_t r = 0; r < N; ++r) {
      float* ps = x + r * D;
      for (int64_t i = 0; i < D; ++i) ps[i] += b[r].m[i];
    }
  }
  for (int64_t r = 0; r < N; ++r) {
    depth_mix(b[r].blocks, nb, x + r * D, c->output_query, D, eps, b[r].mix);
    rms_norm(b[r].mix, c->final_norm, D, eps, h + r * D);
  }
  return 0;
}

}  // extern "C"
