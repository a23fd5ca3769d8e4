// The tokens of a prefill chunk that chose one routed expert, for the layer calls that run a chunk's experts one
// expert at a time (dense_moe_cpu.cpp `dense_moe_layer`, ggml_moe_cpu.cpp `ggml_moe_layer`): every (t, j) with
// ids[t, j] == e, in increasing t then j, with weights[t, j]. These are the per-expert path's picks
// (engine/layers/moe.py: (ids == e).nonzero()), so a token that names the same expert twice gets it twice, once per
// weight: the layer is sum_j weights[t, j] expert_{ids[t, j]}(x_t). (A router's top-k never repeats an expert.)
//
// The picks come in pieces of at most `cap` (the callers' scratch holds T rows; there are more than T picks only
// where a token repeats an expert). Both callers compute a token's row whatever rows are beside it and add the
// pieces to `out` one after the other, so the pieces give the bits of one call over all the picks.
#pragma once

#include <cstdint>

namespace localmoe_moe {

// run(rows, weights, n) for each piece of expert e's picks (n >= 1); stops at the first run that returns false.
// Returns false where a run did, else true (also where e has no picks).
template <class Run>
inline bool for_expert_rows(const int64_t* ids, const float* weights, int64_t T, int64_t k, int64_t e, int64_t cap,
                            int64_t* rows, float* w, Run run) {
  int64_t m = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j)
      if (ids[t * k + j] == e) {
        rows[m] = t;
        w[m++] = weights[t * k + j];
        if (m == cap) {
          if (!run(rows, w, m)) return false;
          m = 0;
        }
      }
  return m == 0 || run(rows, w, m);
}

}  // namespace localmoe_moe
