// The cache-row store and load of cache_rows.h on their own (the fused decode step inlines them), for tests:
// the bits a kernel writes into and reads from a bf16 / fp8 cache buffer against engine/cache.py's.
#include "cache_rows.h"

extern "C" {

// Write x [heads * dim] at position `pos` of the buffer c.
void cache_rows_write(const localmoe_cache::CacheRows* c, int64_t pos, const float* x) {
  localmoe_cache::write(*c, pos, x);
}

// out [dim] <- head h's row at position s of the buffer c holding `length` positions.
void cache_rows_read(const localmoe_cache::CacheRows* c, int64_t h, int64_t s, int64_t length, float* out) {
  const float* r = localmoe_cache::row(*c, h, s, length, out);
  if (r != out) std::memcpy(out, r, c->dim * sizeof(float));
}

}  // extern "C"
