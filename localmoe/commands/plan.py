"""`localmoe plan STORE [--ram] [--gpu-mem]`: placement on this machine and predicted decode speed."""

from __future__ import annotations

import click

from localmoe.commands.base import Command


@click.command("plan", cls=Command)
@click.argument("store", type=click.Path(exists=True))
@click.option("--ram", default="25%", show_default=True, help="Expert RAM budget: bytes (8G) or % of the experts.")
@click.option("--gpu-mem", default="0", show_default=True, help="Expert slots per GPU, bytes (0 = no GPU tier).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), help="Routing trace to predict hit rates.")
def command(store, ram, gpu_mem, trace_path):
    """Measure disk, CPU and PCIe bandwidths, show how the packed store STORE would be placed
    (slots per tier), the hit rate each policy would reach (on --trace, else on a SYNTHETIC trace
    with published locality and on uniform routing) and the predicted decode tokens/s. Bytes per
    dtype / ggml type first; a GGUF file gets those only (it runs resident: convert it to page)."""
    from pathlib import Path

    from localmoe.checkpoint import store_spec
    from localmoe.commands.paged import parse_size
    from localmoe.describe import describe_model, format_type_bytes
    from localmoe.paging import expert_bytes
    from localmoe.paging.placement import measure, place, predict_decode
    from localmoe.paging.simulate import compare
    from localmoe.paging.trace import RoutingTrace, synthetic_trace
    from localmoe.store.packed import PackedStore

    click.echo(f"{Path(store).name}: bytes by type: {format_type_bytes(describe_model(store)['tensor_dtypes'])}")
    if Path(store).is_file():
        click.echo("a GGUF file runs with its experts resident; `localmoe convert FILE STORE` writes a store that "
                   "pages them, then plan the store")
        return
    packed = PackedStore(store)
    spec = store_spec(packed)
    total = expert_bytes(packed)
    slot = max(packed.layout(layer).slot_bytes for layer in packed.layers())
    budget = parse_size(ram, total)
    gpu_budget = parse_size(gpu_mem, total)
    experts = total // slot
    slots = min(budget // slot, experts)  # a budget beyond the model holds every expert, no more
    bw = measure(packed)
    # a next-n (MTP) layer's experts are extents past the model's layers: read only while `--spec mtp` drafts
    layers = [layer for layer in packed.layers() if layer < spec.num_layers]
    nextn = len(packed.layers()) - len(layers)
    click.echo(f"{packed.path.name}: {total / 1e9:.2f} GB of experts, {total // slot} x {slot / 2**20:.2f} MiB; "
               f"{len(layers)} MoE layers" + (f" (+ {nextn} MTP, read only with --spec mtp)" if nextn else "")
               + f", top-{spec.num_experts_per_tok} of {spec.num_experts}")
    fits = " (every expert fits: only first reads miss)" if slots == experts else ""
    click.echo(f"RAM tier: {slots} slots = {slots * slot / 1e9:.2f} GB ({slots * slot / total:.0%} of the experts)"
               + fits)
    gpu_slots = 0
    if gpu_budget and bw.pcie:
        import torch

        gpus = torch.cuda.device_count()
        gpu_slots = gpu_budget // slot * gpus
        click.echo(f"GPU tier: {gpu_budget // slot} slots per GPU x {gpus} GPU(s), layers split into {gpus} "
                   f"contiguous runs; GPU expert compute {bw.gpu_expert / 1e9:.1f} GB/s")
    elif gpu_budget:
        click.echo("GPU tier: none (no CUDA device)")
    click.echo(f"measured: disk {bw.disk / 1e9:.2f} GB/s (4 parallel O_DIRECT reads), CPU expert compute "
               f"{bw.cpu_expert / 1e9:.2f} GB/s" + (f", PCIe {bw.pcie / 1e9:.1f} GB/s" if bw.pcie else ""))
    where = place(slot, 1, bw)
    click.echo(f"host-resident experts at decode: computed on the {where.where.upper()} "
               f"(cpu {where.cpu_seconds * 1e3:.1f} ms vs gpu {where.gpu_seconds * 1e3:.1f} ms per expert)")
    active = len(layers) * spec.num_experts_per_tok
    traces = []
    if trace_path:
        traces.append(("recorded", RoutingTrace.load(trace_path)))
    else:
        traces.append(("SYNTHETIC locality", synthetic_trace(layers, spec.num_experts,
                                                             spec.num_experts_per_tok, 300)))
        traces.append(("SYNTHETIC uniform", synthetic_trace(layers, spec.num_experts,
                                                            spec.num_experts_per_tok, 300, reuse=0.0, zipf=0.0)))
    for label, trace in traces:
        r = compare(trace, max(slots, 1))
        rates = ", ".join(f"{p} {x.hit_rate:.0%}" for p, x in r.items())
        gpu_rate = compare(trace, gpu_slots)["lfru"].hit_rate if gpu_slots else 0.0
        tps = predict_decode(active, slot, r["lfru"].hit_rate, bw, overlap=0.5, gpu_hit_rate=gpu_rate)
        on_gpu = f", GPU hits {gpu_rate:.0%}" if gpu_slots else ""
        click.echo(f"{label}: hit rates {rates}{on_gpu}; predicted decode {tps:.2f} tok/s (lfru, half the reads "
                   f"overlapped)")


def main() -> None:
    command(prog_name="localmoe plan")
