// MoE routing of one token from its router logits, in C for the fused routed-experts call
// (moe_cpu.cpp `mxfp4_moe_routed`): the engine's `route` (engine/layers/moe.py) without group-limited
// top-k, which stays in torch. reference.naive_route is the same rule in PyTorch.
//
//   scoring 0 "softmax":      scores = softmax(logits) over all E experts
//   scoring 1 "sigmoid":      scores = sigmoid(logits)
//   scoring 2 "topk_softmax": scores = logits
//   ids = the k largest of scores + correction (correction may be null), largest first, ties to
//   the lower id; weights = scores[ids], or for topk_softmax the softmax of the k chosen logits;
//   then renormalised (w / (sum w + 1e-20)) if asked, then times `scaling`.
#pragma once

#include <cmath>
#include <cstdint>

namespace localmoe_route {

constexpr int64_t kMaxExperts = 1024;

inline void route_token(const float* logits, int64_t E, int64_t k, int scoring, const float* correction,
                        bool renormalize, float scaling, int64_t* ids, float* weights) {
  float scores[kMaxExperts];
  bool taken[kMaxExperts] = {};
  if (scoring == 0) {
    float top = logits[0];
    for (int64_t e = 1; e < E; ++e) top = std::max(top, logits[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += (scores[e] = std::exp(logits[e] - top));
    for (int64_t e = 0; e < E; ++e) scores[e] /= sum;
  } else {
    for (int64_t e = 0; e < E; ++e) scores[e] = scoring == 1 ? 1.0f / (1.0f + std::exp(-logits[e])) : logits[e];
  }
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    float best_choice = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
      const float choice = correction == nullptr ? scores[e] : scores[e] + correction[e];
      if (!taken[e] && (best < 0 || choice > best_choice)) best = e, best_choice = choice;
    }
    taken[best] = true;
    ids[j] = best;
    weights[j] = scores[best];
  }
  if (scoring == 2) {  // softmax over the chosen logits; weights[0] is the largest
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) sum += (weights[j] = std::exp(weights[j] - scores[ids[0]]));
    for (int64_t j = 0; j < k; ++j) weights[j] /= sum;
  }
  if (renormalize) {
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) sum += weights[j];
    for (int64_t j = 0; j < k; ++j) weights[j] /= sum + 1e-20f;
  }
  if (scaling != 1.0f)
    for (int64_t j = 0; j < k; ++j) weights[j] *= scaling;
}

}  // namespace localmoe_route
