"""Run by test_budget.py in a subprocess: generate inside a memory cgroup (or measure RSS + mincore).

argv: STORE MODE(cgroup|rss) PROVIDER(pager|mmap) BUDGET SLACK CGROUP_NAME -> prints one JSON line.
"""

import json
import os
import sys

store_path, mode, provider, budget, slack, name = sys.argv[1:7]
budget, slack = int(budget), int(slack)
group = None
if mode == "cgroup":
    from localmoe.paging.budget import MemoryCgroup

    group = MemoryCgroup(name)
    group.add(os.getpid())

import torch

from localmoe.config import EngineConfig, PagingConfig
from localmoe.load import load_model
from localmoe.paging import StoreExperts, detach
from localmoe.paging.budget import drop_store_cache, rss_bytes, store_cached_bytes
from localmoe.paging.metrics import pager_of

paging = PagingConfig(ram_budget=budget, io="mmap" if provider == "pager" else "odirect")
config = EngineConfig(dtype="float32", threads=1, paging=paging)
model = load_model(store_path, config, progress=False).model
pager = pager_of(model)
if provider == "mmap":  # the unbudgeted control: experts mapped from the store, the page cache decides
    detach(model)
    pager.close()
    model.use_experts(StoreExperts(pager.store))
cache = model.new_cache(1, 64)
model.forward(torch.tensor([[1, 2, 3]]), cache)  # warm up the allocator on the dense path
drop_store_cache(pager.store)  # a cold start, whatever ran before
baseline = group.usage() if group else rss_bytes() + store_cached_bytes(pager.store)
if group:
    group.set_limit(baseline + slack)
    group.reset_peak()
token = torch.tensor([[7]])
peak_rss = 0
for _ in range(24):
    token = model.forward(token, cache)[:, -1].argmax(-1, keepdim=True)
    peak_rss = max(peak_rss, rss_bytes() + store_cached_bytes(pager.store))
out = {"baseline": baseline, "limit": baseline + slack, "peak_rss_cache": peak_rss,
       "expert_cache": store_cached_bytes(pager.store)}
if group:
    out |= {"max_usage": group.max_usage(), "failcnt": group.failcnt()}
if provider == "pager":
    out |= {"bytes_read": pager.stats.ram.bytes_read, "slots": pager.stats.slots}
print(json.dumps(out))
