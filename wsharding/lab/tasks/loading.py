"""Rank tasks for loading: checkpoints read row range by row range, finalize, the quant variants,
the load peaks, and a Hugging Face Llama end to end (notebook 04, the demo's load numbers, tests).

They live in the package because spawned ranks import tasks by name.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from wsharding.checkpoint import load_checkpoint, load_sharded, save_checkpoint
from wsharding.comm_by_name import shard_comm_for
from wsharding.core.context import RankContext
from wsharding.core.observe import StepObserver, observing
from wsharding.core.runner import aligned_forward
from wsharding.core.sharding import WeightSharding
from wsharding.linear.fp8 import fp8_gemm_path
from wsharding.memory import PeakMeter, map_large_allocations, peak_rss_bytes, rss_bytes
from wsharding.models import DecoderConfig, ToyDecoder, variant_config
from wsharding.models.equality import tokens_for

#: The Llama projections weight sharding takes (all of them: DP-attention style, tp 1).
HF_LLAMA_PATTERNS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class FinalizeStages(StepObserver):
    """Calls ``fn(stage, layer)`` at every stage of a sharding's finalize ([Note: observers] in
    ``wsharding/core/observe.py``): the memory samples behind the redistribution figures."""

    def __init__(self, fn: Callable[[str, int | None], object]) -> None:
        self.fn = fn

    def finalize_stage(self, stage: str, layer: int | None) -> None:
        self.fn(stage, layer)


def held_peak_bytes(result: dict[str, Any]) -> int:
    """The most bytes of sharded weights a :func:`load_variant` rank held (allocated, read from the
    storages) at any step of load + finalize: exact, unlike a measured peak."""
    return max(s["weights"] + s["chunks"] + s["slots"] for s in result["finalize_steps"])


def _bytes_of(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def load_variant(ctx: RankContext, preset: str | DecoderConfig, variant: str, path: str, counts: list[list[int]],
                 *, layers: int | None = None, group_size: int | None = None, comm: str = "torch") -> dict[str, Any]:
    """Write the ``variant`` checkpoint (rank 0), then on every rank: load it into a replicated model
    and into a sharded one (only this rank's rows), finalize, and compare outputs over ``counts``
    steps bit for bit. Measures the load peak (load + finalize) and records the redistribution."""
    cfg = variant_config(preset, variant, layers)
    comm = shard_comm_for(ctx, comm, group_size)
    if comm.device.type == "cpu":
        # Before anything is built: freed blocks must leave the resident set, or they would be
        # reused inside the measurement without showing up (see wsharding.memory).
        map_large_allocations()
    if comm.rank == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_checkpoint(ToyDecoder(cfg, seed=0), path)  # quantized offline, as a ModelOpt/DeepSeek file is
    comm.barrier()
    reference = ToyDecoder(cfg, seed=1, device=comm.device).eval()
    load_checkpoint(reference, path)
    ws = WeightSharding(comm, sharded_layers=range(1, cfg.layers), keep_initial_weights=False)
    model = ToyDecoder(cfg, seed=2, weight_sharding=ws, device=comm.device).eval()  # loading must overwrite
    gc.collect()
    steps: list[dict[str, Any]] = []
    cuda = comm.device.type == "cuda"
    base = torch.cuda.memory_allocated(comm.device) if cuda else rss_bytes()

    def observe(stage: str, layer: int | None) -> None:
        """Accounted bytes (from the storages) and the measured ones: allocated (CUDA) or resident
        (CPU) above the start, plus the row shards that already existed then."""
        now = torch.cuda.memory_allocated(comm.device) + outside() - out0 if cuda else rss_bytes()
        peak = meter.sample() if cuda else peak_rss_bytes() - base + held0
        steps.append({"stage": stage, "layer": layer, **ws.held_bytes(), "measured": now - base + held0,
                      "peak_so_far": peak})

    held0 = ws.held_bytes()["weights"]
    outside = outside_allocator_bytes(comm)
    out0 = outside()
    with PeakMeter(comm.device, held_bytes=held0, outside_allocator=outside) as meter:
        base = torch.cuda.memory_allocated(comm.device) if cuda else rss_bytes()
        loaded = load_checkpoint(model, path)
        observe("loaded", None)
        with observing(ws.observers, FinalizeStages(observe)):
            ws.finalize()
    equal, max_diff = [], 0.0
    with torch.no_grad():
        for s in range(len(counts)):
            x = tokens_for(ctx.rank, s, counts, cfg.vocab, comm.device)
            out = aligned_forward(model, x, model.dummy_tokens)
            if out is None:
                equal.append(None)
                continue
            ref = reference(x)
            equal.append(bool(torch.equal(ref, out)))
            max_diff = max(max_diff, float((ref.float() - out.float()).abs().max()))
    targets = [t for i in ws.sharded_layer_ids for t in ws.targets[i]]
    scales = [p for t in targets for n, p in t.module.named_parameters(recurse=False) if n != "weight"]
    gemm = sorted({fp8_gemm_path(torch.empty(1, t.shape[1], device=comm.device), t.module.weight)
                   for t in targets}) if cfg.quant == "fp8" else []
    reads = []
    for t in targets:
        loader = ws.loaders[(t.layer, t.name)]
        reads.append({"layer": t.layer, "entry": t.entry, "rows": t.rows, "window": list(loader.window),
                      "loaded_rows": loader.loaded_rows, "row_bytes": t.nbytes // t.rows, "mode": t.mode})
    return {
        "rank": ctx.rank,
        "variant": variant,
        "quant": cfg.quant,
        "quant_block": cfg.quant_block if cfg.quant.endswith("_block") else None,
        "mode": comm.mode,
        "emulation": comm.emulation or ctx.emulation,
        "world_size": comm.world_size,
        "shard_modes": sorted({t.mode for t in targets}),
        "fp8_gemm": gemm,
        "equal": equal,
        "max_abs_diff": max_diff,
        "replicated_bytes": ws.replicated_bytes(),
        "layout_payload_bytes": sum(ws.layouts[i].payload_bytes for i in ws.sharded_layer_ids),
        "replicated_scale_bytes": _bytes_of(scales),
        "resident_bytes": ws.resident_bytes(),
        "formula_bytes": ws.formula_bytes(),
        "slot_bytes": ws.slots.slot_bytes,
        "largest_weight_bytes": ws.largest_weight_bytes(),
        "load_peak": meter.result.as_dict(),
        "held_at_load_start": held0,
        "counts": loaded,
        "reads": reads,
        "finalize_steps": steps,
    }


# ---- a Hugging Face Llama end to end -----------------------------------------------------------------
def tiny_llama_config(**overrides: Any):
    """A small ``LlamaConfig`` (2 layers, hidden 64, GQA 4/2 heads): every projection's rows divide
    by 1, 2 and 4 ranks."""
    from transformers import LlamaConfig

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    kw.update(overrides)
    return LlamaConfig(**kw)


def build_llama(config, seed: int):
    """``LlamaForCausalLM(config)`` with random weights from ``seed`` (no download), in eval mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def save_llama(ctx: RankContext, path: str, seed: int = 0, **overrides: Any) -> dict[str, Any]:
    """Rank 0 builds the model and ``save_pretrained`` it to ``path`` (safetensors)."""
    if ctx.rank == 0:
        build_llama(tiny_llama_config(**overrides), seed).save_pretrained(path)
    return {"rank": ctx.rank, "path": path}


def llama_prompt(rank: int, step: int, counts: list[list[int]], vocab: int) -> torch.Tensor:
    """This rank's prompt at ``step`` as ``[1, T]`` token ids (``T = 0``: an idle rank)."""
    return tokens_for(rank, step, counts, vocab, torch.device("cpu")).unsqueeze(0)


def hf_llama_sharded(ctx: RankContext, path: str, counts: list[list[int]], *, group_size: int | None = None,
                     patterns: tuple[str, ...] = HF_LLAMA_PATTERNS) -> dict[str, Any]:
    """Load the saved Llama twice: unsharded with ``from_pretrained`` (Hugging Face's own loader), and
    with its projections sharded over the group by :func:`~wsharding.checkpoint.load_sharded`, which
    reads only this rank's rows; compare the logits bit for bit over ``counts`` steps (an idle rank
    runs a one-token dummy step)."""
    from transformers import LlamaForCausalLM

    comm = shard_comm_for(ctx, "torch", group_size)
    reference = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # Built by load_sharded with every parameter on meta (no weight is ever whole): the checkpoint
    # fills every one of them, or the load is refused.
    ws = load_sharded(lambda: build_llama(reference.config, seed=1000 + ctx.rank), path, "model.layers",
                      list(patterns), comm)
    model = ws.model
    vocab = reference.config.vocab_size
    equal, gathers = [], []
    with torch.no_grad():
        for s in range(len(counts)):
            ids = llama_prompt(ctx.rank, s, counts, vocab)
            out = aligned_forward(lambda x: model(x, use_cache=False).logits, ids,
                                  lambda: torch.zeros(1, 1, dtype=torch.long))
            gathers.append(ws.planner.gathers_this_step)
            if out is None:
                equal.append(None)
                continue
            equal.append(bool(torch.equal(reference(ids, use_cache=False).logits, out)))
    per_target = {f"{t.layer}.{t.entry}": [t.rows // comm.world_size, t.nbytes // t.rows]
                  for ts in ws.targets.values() for t in ts}
    return {
        "rank": ctx.rank,
        "mode": comm.mode,
        "emulation": ctx.emulation,
        "equal": equal,
        "gathers": gathers,
        "counts": ws.load_result,
        "rows_and_row_bytes": per_target,
        "sharded_layers": ws.sharded_layer_ids,
        "parameters_kept": sum(1 for n, _ in model.named_parameters()) == sum(1 for _ in reference.parameters()),
        "resident_bytes": ws.resident_bytes(),
        "formula_bytes": ws.formula_bytes(),
        "replicated_bytes": ws.replicated_bytes(),
        "slot_bytes": ws.slots.slot_bytes,
        "slots": ws.slots.count,
    }


def outside_allocator_bytes(comm: Any) -> Callable[[], int]:
    """A counter of the bytes ``comm`` holds outside torch's allocator: our NCCL communicator's
    ncclMemAlloc'd windows ([Note: two allocators] in ``wsharding.memory``); 0 for the others."""
    pool = comm.pool
    if pool is None:
        return lambda: 0
    return lambda: pool.allocated_bytes


# ---- the demo's load numbers ------------------------------------------------------------------------
def build_pair_measured(cfg: DecoderConfig, comm, **kwargs: Any) -> tuple[ToyDecoder, ToyDecoder, dict[str, Any]]:
    """:func:`wsharding.models.build_pair`, with the sharded model's finalize measured: the peak from
    the built row shards (held at the start) through the redistribution, and its bound
    ``R/N + padding/N + 2 slots + one weight`` (the demo's load numbers; ``finalize_bound_bytes``).
    ``kwargs``: ``seed``, ``lookahead``, ``trace``, ``map_own_chunk``."""
    from wsharding.linear import process_weights

    if comm.device.type == "cpu":
        map_large_allocations()
    replicated = ToyDecoder(cfg, seed=kwargs.get("seed", 0), device=comm.device).eval()
    process_weights(replicated)
    ws = WeightSharding(comm, sharded_layers=range(1, cfg.layers), lookahead=kwargs.get("lookahead", True),
                        trace=kwargs.get("trace", False), map_own_chunk=kwargs.get("map_own_chunk", "auto"))
    sharded = ToyDecoder(cfg, seed=kwargs.get("seed", 0), weight_sharding=ws, device=comm.device).eval()
    process_weights(sharded)
    gc.collect()
    outside = outside_allocator_bytes(comm)
    with PeakMeter(comm.device, held_bytes=ws.held_bytes()["weights"], outside_allocator=outside) as meter:
        with observing(ws.observers, FinalizeStages(lambda stage, layer: meter.sample())):
            ws.finalize()
    load = {**meter.result.as_dict(), "bound_bytes": ws.finalize_bound_bytes(),
            "largest_weight_bytes": ws.largest_weight_bytes()}
    return replicated, sharded, load
