"""Long context in bounded memory: the working memory of one prefill chunk (peak RSS of the forward
call over the RSS before it, the cache already allocated) must not grow with the context.

Each measurement runs in a fresh interpreter. The caches are filled with random rows up to the
context (prefilling 32k tokens would take minutes), then one chunk of real tokens runs at the end.
The key blocks are shrunk (SCORES_MAX_BYTES, KV_BLOCK_BYTES) so that both contexts span several blocks; before
the fix, MLA's per-head mask copies and [H*T, S] scores made the 32k chunk need ~4x the 8k one."""

import json
import subprocess
import sys

import pytest

from localmoe.testing import write_checkpoint

SCRIPT = r"""
import json, sys, torch
from localmoe.config import EngineConfig
from localmoe.engine.layers import mla
from localmoe.engine.cache import KVCache
from localmoe.engine.state_cache import DeltaStateCache, LatentCache
from localmoe.load import load_model

def rss(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

path, context, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
mla.SCORES_MAX_BYTES = 1 << 20
mla.KV_BLOCK_BYTES = 1 << 18
torch.set_num_threads(1)
model = load_model(path, EngineConfig(dtype="float32", max_context=context + chunk), progress=False).model
cache = model.new_cache(1, context + chunk)
g = torch.Generator().manual_seed(0)
for layer in cache.layers:  # every position the chunk will write is allocated and touched up front
    for s in range(0, context + chunk, 4096):
        n = min(4096, context + chunk - s)
        if isinstance(layer, LatentCache):
            layer.update(s, torch.randn(1, n, layer.rows.dim, generator=g))
        elif isinstance(layer, KVCache):
            k = torch.randn(1, n, layer.keys.heads, layer.keys.dim, generator=g)
            layer.update(s, k, k)
    if isinstance(layer, DeltaStateCache):
        layer.offset = context
cache.offset = context
cache.snapshot()  # lets the warm-up call below be undone
tokens = torch.randint(0, model.spec.vocab_size, (1, chunk), generator=g)
model.forward(tokens[:, :8], cache)  # first call: lazy initialisation (kernels, plans) is not the chunk's
cache.trim(context)
base = rss("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
model.forward(tokens, cache)
print(json.dumps({"working": rss("VmHWM") - base, "cache": cache.nbytes()}))
"""


def chunk_memory(path, context: int, chunk: int) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(path), str(context), str(chunk)], capture_output=True,
                         text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads and resets the peak RSS through /proc")
@pytest.mark.parametrize("family", ["kimi_k3", "qwen3_next"])
def test_prefill_chunk_memory_does_not_grow_with_context(tmp_path, family):
    path = write_checkpoint(family, tmp_path / family, "tiny", seed=0)
    short, long = (chunk_memory(path, context, 128) for context in (8192, 32768))
    assert long["cache"] > 3 * short["cache"]  # the contexts differ as intended
    # a chunk that kept [H*T, S] scores or per-head copies of the mask would need ~4x the memory at 32k
    assert long["working"] <= 1.3 * short["working"] + (4 << 20), (short, long)
