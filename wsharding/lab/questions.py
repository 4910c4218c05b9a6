"""The "Check yourself" questions of every notebook, kept out of the cells a learner edits.

A question's text, hint and explanation (``why``) live here, keyed by notebook and looked up by id
(``"00.q1"``); its answer is computed by the package, from the package's own presets or from what the
notebook's run produced (passed by name: ``ask("03.q2", table=eight)``). The cell a learner edits then
holds only the prediction and the check::

    q1, q2, q3 = questions("00")
    my_bytes_per_rank = None      # <- your prediction
    q1.check(my_bytes_per_rank)

Nothing on the page gives the answer away until the learner asks for it (:meth:`Question.reveal`, or
the panel's "Show answer").
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from wsharding.core.errors import InvalidArgument, NotFound
from wsharding.lab.quiz import Question

Text = str | Callable[..., str]


@dataclass(frozen=True)
class Spec:
    """One question as stored: ``answer`` computes the package's answer; ``text`` and ``why`` may be
    functions of the same named inputs (a number the run measured, quoted in the question)."""

    text: Text
    answer: Callable[..., Any]
    hint: Text
    why: Text
    unit: str = ""
    rel: float = 0.0


# ---- answers computed from the package alone --------------------------------------------------------
def _k3_plan(link_gbps: float | None = None) -> Any:
    from wsharding.costmodel import GB, Deployment, estimate, get_device
    from wsharding.presets import load_preset

    kw = {} if link_gbps is None else {"link_bandwidth": link_gbps * GB}
    return estimate(load_preset("kimi-k3-b200-fp8"), Deployment(ranks=8, device=get_device("b200"), tokens=256, **kw))


def _moe_layer_per_rank() -> int:
    from wsharding.costmodel import Deployment, estimate, get_device
    from wsharding.presets import load_preset

    plan = estimate(load_preset("kimi-k3-b200-moe-bf16"), Deployment(ranks=8, device=get_device("b200"), tokens=256))
    return plan.layers[0].layout_bytes // 8


def _quiz_layout() -> Any:
    """01's layer: ``a`` 50 x bf16 then ``b`` 30 x uint8, on N = 4 ranks."""
    import torch

    from wsharding.core.layout import FlatLayout

    return FlatLayout([("a", (50,), torch.bfloat16), ("b", (30,), torch.uint8)], group_size=4)


def _qkv_rank3() -> Any:
    """05's linear: 64 query heads, 4 KV heads, head size 128, hidden 4096, rank 3 of TP = 8."""
    import torch

    from wsharding.linear import ParallelState, QKVParallelLinear

    return QKVParallelLinear(4096, 128, 64, 4, bias=False, params_dtype=torch.bfloat16,
                             parallel_state=ParallelState.logical(8, 3))


def _exposed_ms_slow_gathers() -> float:
    from wsharding.lab.tasks.planner import model_schedule

    recs = model_schedule(6, gather_ms=15.0, compute_ms=10.0)
    return sum(r["wait_end"] - r["wait_start"] for r in recs if "wait_end" in r) / 1e3


def _sharded_layers(preset: str) -> int:
    from wsharding.models import decoder_config

    return decoder_config(preset).layers - 1  # layer 0 stays dense


def _bill_at_2(layer: Any, n: int) -> Any:
    from wsharding.core.layout import FlatLayout
    from wsharding.costmodel import bill_for_layouts

    return bill_for_layouts([FlatLayout([(e.name, e.shape, e.dtype) for e in layer.entries], 2)], n)


def _resident_at(layouts: list[Any], n: int) -> int:
    """What a rank keeps (chunks and two slots) with the same layers cut over ``n`` ranks."""
    from wsharding.core.layout import FlatLayout
    from wsharding.costmodel import bill_for_layouts

    return bill_for_layouts([FlatLayout([(e.name, e.shape, e.dtype) for e in lay.entries], n)
                             for lay in layouts]).sharded_resident_bytes


def _link_floor_ms(blocks: dict, n: int) -> float:
    from wsharding.costmodel.plan import gather_seconds

    return blocks["sharded_layers"] * gather_seconds(LLAMA8B_BLOCK_BYTES, n, blocks["bus_bandwidth_GBps"] * 1e9) * 1e3


#: One block of ``llama8b-blocks`` (Llama-3.1-8B-shaped, BF16), bytes.
LLAMA8B_BLOCK_BYTES = 436_207_616


def _comm(name: str) -> Any:
    """A function of the communication lesson's figures module (02), imported when a question asks."""
    from wsharding.lab.viz import comm as comm_figures

    return getattr(comm_figures, name)


BANK: dict[str, dict[str, Spec]] = {
    "00": {
        "q1": Spec("bytes of one 367 MB layer kept per GPU at N = 8", lambda: _moe_layer_per_rank(),
                   hint="pad the layer up to the next multiple of 16 * N bytes first, then divide by N.",
                   why="|T| is padded to a multiple of 16*8 = 128 B: 367,000,064 B, and each rank keeps 1/8 of it.",
                   unit=" B"),
        "q2": Spec("break-even tokens, N = 8, 900 GB/s", lambda: _k3_plan().breakeven_tokens, rel=0.10,
                   hint="divide the largest layer's gather time by the compute time per token of the layer before it.",
                   why="the gather time of the largest layer divided by the compute time per token of the layer "
                       "before it."),
        "q3": Spec("break-even tokens at 450 GB/s", lambda: _k3_plan(450).breakeven_tokens, rel=0.10,
                   hint="which of the two times changes when only the link slows down?",
                   why="half the bandwidth doubles every gather, and the compute per token stays: about twice the "
                       "tokens."),
    },
    "01": {
        "q1": Spec("offset of b", lambda: _quiz_layout().entry("b").offset, unit=" B",
                   hint="a starts at 0 and is 100 B long; where may the next entry start?",
                   why="every entry starts on a 16-byte boundary: align16(100) = 112."),
        "q2": Spec("chunk bytes C", lambda: _quiz_layout().chunk_bytes, unit=" B",
                   hint="find where b ends, pad the total up to a multiple of 16 * N, then split it N ways.",
                   why="the payload ends at 142; |T| is padded to a multiple of 16*4 = 64: 192, and C = 192 / 4."),
        "q3": Spec("the rank that holds only padding",
                   lambda: next(r for r in range(4) if not _quiz_layout().pieces(r)),
                   hint="compare each rank's byte range [rC, (r+1)C) with the byte where b ends.",
                   why="rank 3 owns bytes [144, 192): all after the end of b (142) -- the chunk still travels in "
                       "the gather."),
    },
    "02": {
        "q1": Spec("tokens from which the activation AllReduce moves more than the weight gather, S = 367 MB, "
                   "hidden 7168, N = 8",
                   lambda: _comm("crossover_tokens")(367_000_000, 7168, 8),
                   hint="set the two formulas equal: the (N-1)/N factors cancel; solve for tokens.",
                   why="2 * t * 7168 * 2 B > S  <=>  t > S / 28672 = 12,799.94: weight sharding's traffic is "
                       "smaller at any smaller batch."),
        "q2": Spec("bytes each rank receives per layer, S = 436,207,616 B, N = 2",
                   lambda: _comm("collective_bytes")(LLAMA8B_BLOCK_BYTES, 1, 4096, 2)["allgather_weights"],
                   unit=" B", hint="each rank already holds its own chunk; which share of S does it still need?",
                   why="a ring AllGather brings every rank the (N-1)/N of the layer it does not hold: 1/2 of S at "
                       "N = 2, whatever the batch."),
        "q3": Spec("tokens from which the activation AllReduce moves more, same layer, hidden 4096, N = 2",
                   lambda: _comm("crossover_tokens")(LLAMA8B_BLOCK_BYTES, 4096, 2),
                   hint="the (N-1)/N factors cancel whatever N is: only S and the hidden size are left.",
                   why="2 * t * 4096 * 2 B > S  <=>  t > S / 16384 = 26,624: a larger layer over a smaller "
                       "hidden size moves the crossover up."),
    },
    "03": {
        "q1": Spec("gathers per step, tiny decoder with 8 layers", lambda table: len(table),
                   hint="count the sharded layers; the dense layer 0 is not one of them.",
                   why="one gather per sharded layer per step: layers 1..7."),
        "q2": Spec("the slot of layer 6 (A or B)", lambda table: table[6]["slot"],
                   hint="slots alternate by position among the sharded layers, starting with A at the first one.",
                   why="1 A, 2 B, 3 A, 4 B, 5 A, 6 B."),
        "q3": Spec("the layer whose done event gates layer 6's gather", lambda table: table[6]["gate"],
                   hint="which layer read layer 6's slot last before it?",
                   why="the previous occupant of slot B: layer 6 may overwrite it only once that layer has "
                       "finished."),
        "q4": Spec("exposed wait of the step, ms", lambda: _exposed_ms_slow_gathers(), unit=" ms", rel=0.01,
                   hint="the first gather has one layer to hide behind; after that, each gather waits for the "
                        "one before it.",
                   why="the first gather hides 10 of its 15 ms behind layer 0; every later one exposes "
                       "15 - 10 = 5 ms."),
    },
    "04": {
        "q1": Spec(lambda: (f"share of R a rank keeps, N = 2, the small preset at its own depth: "
                            f"{_sharded_layers('small')} sharded layers (not the 11 of this notebook's runs)"),
                   lambda: round(100 * _resident_share("small", 2)), rel=0.03, unit=" %",
                   hint="add up what stays: 1/N of every sharded layer, plus two slots that each hold one whole "
                        "layer.",
                   why=lambda: (f"50 % in chunks plus 2 x {100 / _sharded_layers('small'):.0f} % in the two slots: "
                                f"with only {_sharded_layers('small')} sharded layers one slot is "
                                f"1/{_sharded_layers('small')} of R, so two slots eat most of what N = 2 saves. "
                                "1/N + 2/L must be well below 1.")),
        "q2": Spec("fewest sharded layers at N = 4 for which a rank keeps at most half of R",
                   lambda: min(n for n in range(1, 100) if _resident_share("small", 4, layers=n + 1) <= 0.5),
                   hint="the chunks already take 1/4 of R; what is left for the two slots?",
                   why="1/4 + 2/L <= 1/2 once L >= 8: the two slots together may then cost at most a quarter of R."),
        "q3": Spec("the variant whose load peak is above R (bf16, int8, fp8 or fp8_block)",
                   lambda: ", ".join(_requant_then_shard()),
                   hint="which format must change a weight as a whole before it can be cut into chunks?",
                   why="block FP8 is requant-then-shard: the UE8M0 requant runs on the whole weight, so every "
                       "rank holds the full weights (R) and the slots during finalize; only afterwards do they "
                       "shrink. Section 4 measures it."),
    },
    "05": {
        "q1": Spec("rows of rank 3's fused qkv weight", lambda: _qkv_rank3().weight.shape[0],
                   hint="count the query heads this rank holds, then the K and V heads, each 128 rows.",
                   why="64/8 = 8 q heads x 128 rows, plus one k and one v head (4 KV heads < 8 ranks: one each) "
                       "x 128."),
        "q2": Spec("ranks sharing (replicating) each KV head: num_kv_head_replicas",
                   lambda: _qkv_rank3().num_kv_head_replicas,
                   hint="there are fewer KV heads than ranks; every rank needs one.", why="8 ranks / 4 KV heads."),
        "q3": Spec("first checkpoint row of rank 3's K block (counted inside the K block)",
                   lambda: _qkv_rank3().row_sub_blocks()[1][3],
                   hint="first find which KV head rank 3 holds (ranks share heads in consecutive pairs).",
                   why="rank 3 holds KV head 3 // 2 = 1, whose rows start at 1 x 128 of the K block."),
    },
    "06": {
        "q1": Spec("gathers per step of tiny-deep (12 layers)", lambda: _sharded_layers("tiny-deep"),
                   hint="count the layers whose weights are sharded; layer 0 is dense.",
                   why="one gather per sharded layer; the dense layer 0 has none: 11."),
        "q2": Spec("resident bytes per rank if this decoder were sharded over 8 ranks instead of 4",
                   lambda layouts: _resident_at(layouts, 8), unit=" B",
                   hint="each rank keeps 1/8 of every sharded layer (padded to a multiple of 16 x 8 B), plus two "
                        "slots of the largest layer.",
                   why="the chunks shrink to |T|/8 per layer, but the two slots stay whole layers: doubling N "
                       "does not halve what a rank keeps."),
        "q3": Spec("net saving per rank of tiny (3 sharded layers) at N = 2",
                   lambda layer: _bill_at_2(layer, 3).net_saving_bytes, unit=" B",
                   hint="what do three half-layers give back, and what do two full slots cost?",
                   why="R - (3 |T|/2 + 2 |T|) = -|T|/2: the two slots cost more than three layers give back."),
        "q4": Spec("fewest sharded layers that save memory at N = 2",
                   lambda layer: next(n for n in range(1, 100) if _bill_at_2(layer, n).net_saving_bytes > 0),
                   hint="compare what n half-layers give back with what two whole-layer slots cost.",
                   why="n/2 layers given back must exceed the two slots: n > 4."),
    },
    "07": {
        "q1": Spec("share of the budget the sharded KV pool holds, where the replicated pool holds 30 %",
                   lambda rated: rated["rows_by_budget"][0]["sharded"]["kv_share"], rel=0.02,
                   hint="same budget, same reserve: the sharded pool also gets the bytes sharding gives back "
                        "(R minus the chunks and the slots); compare them with the budget.",
                   why=lambda rated: ("the pool is what the budget leaves after the resident weights and the "
                                      "reserve; sharding leaves R - R/N - slots more, here "
                                      f"{(rated['rows_by_budget'][0]['sharded']['kv_share'] - 0.3):.0%} of the "
                                      "budget on top of the replicated 30 %.")),
        "q2": Spec("extra KV tokens of the sharded pool at the tightest budget",
                   lambda served: (served["rows_by_budget"][0]["sharded"]["pool_tokens"]
                                   - served["rows_by_budget"][0]["replicated"]["pool_tokens"]),
                   rel=0.01, unit=" tokens",
                   hint=lambda: ("the bytes sharding gives back per rank, divided by the KV bytes of one token -- "
                                 f"then down to whole {_block_tokens()}-token blocks: each pool is a number of "
                                 "blocks, not of tokens."),
                   why=lambda served: ("same budget, same reserve: the pools differ by R minus the chunks and the "
                                       f"two slots, divided by {served['kv_bytes_per_token']:,} B per token.")),
    },
    "08": {
        "q1": Spec(lambda blocks: (f"link floor of 8 layers of {LLAMA8B_BLOCK_BYTES:,} B on 2 GPUs at "
                                   f"{blocks['bus_bandwidth_GBps']:.1f} GB/s, ms"),
                   lambda blocks: blocks["rows"][0]["floor_ms"], rel=0.02, unit=" ms",
                   hint="each rank receives (N-1)/N of every layer; time = bytes / bandwidth, for all layers.",
                   why="8 x (1/2) x 436 MB at the measured bus bandwidth."),
        "q2": Spec("link floor on 8 GPUs at the same bus bandwidth, ms", lambda blocks: _link_floor_ms(blocks, 8),
                   rel=0.02, unit=" ms", hint="only the fraction (N-1)/N changes with N.",
                   why="each rank now receives 7/8 of every layer instead of 1/2: 1.75x the floor of 2 GPUs, "
                       "while each rank stores a quarter as much."),
    },
}


def _resident_share(preset: str, group: int, **kw: Any) -> float:
    from wsharding.lab.memory import resident_share

    return resident_share(preset, group, **kw)


def _block_tokens() -> int:
    from wsharding.serve import BLOCK_TOKENS

    return BLOCK_TOKENS


def _requant_then_shard() -> list[str]:
    """The loading variants whose quant method requantizes the whole weight before it is cut."""
    from wsharding.linear.methods import METHODS
    from wsharding.models.decoder import VARIANTS

    return [v for v, q in VARIANTS.items() if getattr(METHODS[q], "weight_shard_mode", "rows") == "requant_then_shard"]


def _call(f: Text, qid: str, given: dict[str, Any]) -> Any:
    if not callable(f):
        return f
    names = list(inspect.signature(f).parameters)
    missing = [n for n in names if n not in given]
    if missing:
        raise InvalidArgument(f"question {qid} is computed from {', '.join(missing)}: pass "
                              + ", ".join(f"{n}=..." for n in missing))
    return f(**{n: given[n] for n in names})


def ask(qid: str, **given: Any) -> Question:
    """The question ``qid`` (``"NN.qK"``), its answer computed now from the package and ``given``."""
    nb, _, key = qid.partition(".")
    spec = BANK.get(nb, {}).get(key)
    if spec is None:
        raise NotFound(f"no question {qid!r}; notebook {nb!r} has {sorted(BANK.get(nb, {}))}")
    return Question(_call(spec.text, qid, given), _call(spec.answer, qid, given), rel=spec.rel, unit=spec.unit,
                    hint=_call(spec.hint, qid, given), why=_call(spec.why, qid, given))


def questions(notebook: str, *keys: str, **given: Any) -> tuple[Question, ...]:
    """The questions of ``notebook`` (``"00"``), in order; only ``keys`` when given (``"q1"``, ...)."""
    if notebook not in BANK:
        raise NotFound(f"no questions for notebook {notebook!r}; known: {sorted(BANK)}")
    return tuple(ask(f"{notebook}.{k}", **given) for k in (keys or BANK[notebook]))
