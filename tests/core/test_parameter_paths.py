"""Every way torch reaches a sharded weight's Parameter after finalize: each is the real weight, or a
ShardingError that names the weight and the rank and says what to do instead.

Between steps a sharded weight is a view of a slot that holds another layer's bytes (the slot is
refilled every step by whichever layer uses it); inside its linear's forward it holds its own. So:

1. ``w.data.mul_(2)`` between steps is refused at once (torch's own ``.data`` has a fresh version
   counter: the edit went through and the next gather undid it);
2. reads of ``model.parameters()`` -- ``clone``, ``detach().cpu()``, ``tolist``, ``torch.save``,
   ``deepcopy``, arithmetic -- are refused, pointing to ``full_state_dict``; metadata (``numel``,
   shapes) and printing (no values) still answer;
3. ``linear.weight = nn.Parameter(new)`` is refused (``full_state_dict`` would have saved the old
   weight), and so is ``full_state_dict`` after a replacement made behind the guard;
4. module conversions and re-parametrizations: a no-op (``.float()`` of float32, ``.to()`` where it
   is) runs, every other one is refused;
5. the weight used outside its linear (``x @ w.t()``, with or without autograd) is refused.

Each case shows first what the unguarded path gives (the weight read with torch's own
implementation, or its Parameter's guard taken off), then the refusal. Two CPU ranks (gloo), the
small GPT of ``test_sharded_weight_guards.py``.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

from tests.core.test_sharded_weight_guards import _error, _pair
from wsharding.core.bound import raw_access
from wsharding.core.guards import bound_weights
from wsharding.core.sharding import ShardingError

_FULL = "WeightSharding.full_state_dict(model)"


def _refused(err, rank: int, label: str, *words: str) -> None:
    assert err is not None, f"{label}: it ran"
    cls, msg = err
    assert cls == ShardingError.__name__, msg
    conversion = f"{label} is a view of a weight-sharding slot after finalize, on rank {rank}"
    assert msg.startswith((f"{label} on rank {rank}: ", conversion)), msg
    for w in words:
        assert w in msg, (w, msg)


# ---- 1. .data --------------------------------------------------------------------------------------
def data_between_steps(ctx):
    ref, model, ws, x = _pair(ctx)
    w, want = model.blocks[1].q_proj.weight, ref.blocks[1].q_proj.weight
    edited = copy.deepcopy(ref)
    out = {"rank": ctx.rank}
    with torch.no_grad():
        model(x)
        # what w.data.mul_(2) did without the fix: torch's own .data, a fresh version counter
        with raw_access():
            torch._C.TensorBase.data.__get__(w).mul_(2)
        edited.blocks[1].q_proj.weight.mul_(2)
        y = model(x)  # no error: the gather undid the edit
        out["unguarded_equal_edited"] = torch.equal(y, edited(x))
        out["unguarded_equal_unedited"] = torch.equal(y, ref(x))
        out["edit"] = _error(lambda: w.data.mul_(2))
        out["copy"] = _error(lambda: w.data.copy_(want))
        out["metadata"] = (list(w.data.shape) == list(want.shape) and w.data.dtype == want.dtype
                           and w.data.data_ptr() == w.data_ptr())
        w.data = w.data  # the same tensor: a no-op
        out["equal"] = torch.equal(model(x), ref(x))
    ws.close()
    return out


def test_data_of_a_sharded_weight_refuses_edits_between_steps(cluster_of):
    for r in cluster_of(2).run(data_between_steps):
        assert not r["unguarded_equal_edited"] and r["unguarded_equal_unedited"]  # what the guard prevents
        for what, op in (("edit", "Tensor.mul_"), ("copy", "Tensor.copy_")):
            _refused(r[what], r["rank"], "layer 1 q_proj.weight", f"{op} outside its linear's forward",
                     "the edit would land in those bytes", _FULL)
        assert r["metadata"] and r["equal"]


# ---- 2. model.parameters() -------------------------------------------------------------------------
def _save(tensors):
    torch.save(tensors, io.BytesIO())


def reads_of_parameters(ctx):
    ref, model, ws, x = _pair(ctx)
    out = {"rank": ctx.rank}
    with torch.no_grad():
        model(x)
    named, want = dict(model.named_parameters()), dict(ref.named_parameters())
    bound = bound_weights(model)
    with raw_access():  # without the guard: the slot's bytes now
        out["unguarded_wrong"] = sum(not torch.equal(named[k], want[k]) for k in bound)
    out["bound"] = len(bound)
    out["numel"] = sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    out["meta"] = all(named[k].shape == want[k].shape and named[k].dtype == want[k].dtype
                      and named[k].device == want[k].device for k in want)
    p = named["blocks.0.q_proj.weight"]
    reads = {
        "clone": lambda: p.clone(),
        "detach.cpu": lambda: p.detach().cpu(),
        "tolist": lambda: p.tolist(),
        "torch.save": lambda: _save(list(model.parameters())),
        "deepcopy": lambda: copy.deepcopy(p),
        "sum": lambda: p.sum(),
        "equal": lambda: torch.equal(p, want["blocks.0.q_proj.weight"]),
        "vector": lambda: nn.utils.parameters_to_vector(model.parameters()),
    }
    out["reads"] = {k: _error(f) for k, f in reads.items()}
    # The model whole: its hooks reach the planner, which refuses to be copied (one message for all three).
    out["whole"] = {k: _error(f) for k, f in {
        "deepcopy(model)": lambda: copy.deepcopy(model), "torch.save(model)": lambda: _save(model),
        "pickle": lambda: pickle.dumps(model)}.items()}
    out["repr"] = repr(p), f"{p}"
    out["print_model"] = _error(lambda: str(model))
    with torch.no_grad():
        out["equal"] = torch.equal(model(x), ref(x))
    full = ws.full_state_dict(model)
    out["full_exact"] = all(torch.equal(full[k], v) for k, v in ref.state_dict().items())
    ws.close()
    return out


def test_reading_parameters_of_a_sharded_model_is_refused_and_points_to_full_state_dict(cluster_of):
    for r in cluster_of(2).run(reads_of_parameters):
        assert r["unguarded_wrong"] > 0, "the slots held every layer's weights"  # what the guard prevents
        assert r["bound"] == 24 and r["numel"] and r["meta"]
        for err in r["reads"].values():  # each names the weight it reached first: blocks.0.q_proj.weight
            _refused(err, r["rank"], "layer 0 q_proj.weight", "outside its linear's forward",
                     "a copy, print, save or computation would get those bytes", _FULL, "call its linear")
        for what, err in r["whole"].items():
            assert err is not None and err[0] == ShardingError.__name__, (what, err)
            assert "cannot be copied or saved whole" in err[1] and _FULL in err[1], (what, err)
        for text in r["repr"]:
            assert text.startswith(f"SlotBoundParameter(layer 0 q_proj.weight on rank {r['rank']}, [48, 48], "
                                   "torch.float32, cpu: a view of a weight-sharding slot")
            assert "full_state_dict" in text
        assert r["print_model"] is None
        assert r["equal"] and r["full_exact"]


# ---- 3. a new weight -------------------------------------------------------------------------------
def replaced_weight(ctx):
    ref, model, ws, x = _pair(ctx)
    lin, key = model.blocks[1].fc1, "blocks.1.fc1.weight"
    bound = lin.weight
    new = torch.randn(bound.shape, generator=torch.Generator().manual_seed(5))
    out = {"rank": ctx.rank}
    before = ws.full_state_dict(model)
    swapped = copy.deepcopy(ref)
    swapped.blocks[1].fc1.weight = nn.Parameter(new.clone())
    # without the guard (the dict write that `lin.weight = ...` makes, behind torch's registration hook):
    # the forward computes with the new weight, while the chunks -- what full_state_dict saves -- hold the old
    lin._parameters["weight"] = nn.Parameter(new.clone())
    with torch.no_grad():
        out["unguarded_forward_new"] = torch.equal(model(x), swapped(x))
    out["unguarded_chunks_old"] = torch.equal(before[key], ref.state_dict()[key]) and not torch.equal(before[key], new)
    out["full_after_swap"] = _error(lambda: ws.full_state_dict(model))
    lin._parameters["weight"] = bound
    out["assign"] = _error(lambda: setattr(lin, "weight", nn.Parameter(new.clone())))
    out["register"] = _error(lambda: lin.register_parameter("weight", nn.Parameter(new.clone())))
    lin.weight = lin.weight  # the same Parameter: allowed
    out["same"] = lin.weight is bound
    with torch.no_grad():
        out["equal"] = torch.equal(model(x), ref(x))
    out["full_exact"] = torch.equal(ws.full_state_dict(model)[key], ref.state_dict()[key])
    ws.close()
    return out


def test_a_new_weight_on_a_sharded_linear_is_refused(cluster_of):
    for r in cluster_of(2).run(replaced_weight):
        rank = r["rank"]
        assert r["unguarded_forward_new"] and r["unguarded_chunks_old"]  # what the guard prevents
        cls, msg = r["full_after_swap"]
        assert cls == ShardingError.__name__
        assert msg.startswith(f"full_state_dict on rank {rank}: layer 1 fc1.weight is no longer the Parameter")
        for what in ("assign", "register"):
            _refused(r[what], rank, "layer 1 fc1.weight", "a new Parameter assigned as the weight", _FULL,
                     "Assign or load weights before finalize")
        assert r["same"] and r["equal"] and r["full_exact"]


# ---- 4. conversions and re-parametrizations ---------------------------------------------------------
class _Double(nn.Module):
    def forward(self, w):
        return 2 * w


def _init(m):
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight)


def _replace_data(m):
    if isinstance(m, nn.Linear):
        m.weight.data = torch.zeros(m.weight.shape)


CONVERSIONS = {
    # name: (what it does to a model, its refusal's words or None when it is a no-op that runs)
    "half": (lambda m: m.half(), "Tensor.half (torch.float32 on cpu -> torch.float16 on cpu)"),
    "to float64": (lambda m: m.to(torch.float64), "Tensor.to (torch.float32 on cpu -> torch.float64 on cpu)"),
    "to meta": (lambda m: m.to("meta"), "Tensor.to (torch.float32 on cpu -> torch.float32 on meta)"),
    "float": (lambda m: m.float(), None),
    "to cpu": (lambda m: m.to("cpu"), None),
    "apply init": (lambda m: m.apply(_init), "nn.init.normal_ outside its linear's forward"),
    "apply data": (lambda m: m.apply(_replace_data), "replacing its data"),
    "parametrize": (lambda m: nn.utils.parametrize.register_parametrization(m.blocks[0].fc1, "weight", _Double()),
                    "outside its linear's forward"),
    "parametrize unsafe": (lambda m: nn.utils.parametrize.register_parametrization(
        m.blocks[0].fc1, "weight", _Double(), unsafe=True), "Tensor.set_ outside its linear's forward"),
    "weight_norm": (lambda m: nn.utils.weight_norm(m.blocks[0].fc1), "norm_except_dim outside its linear's forward"),
    "parametrizations.weight_norm": (lambda m: nn.utils.parametrizations.weight_norm(m.blocks[0].fc1),
                                     "outside its linear's forward"),
}


def conversion(ctx, name: str, guarded: bool):
    ref, model, ws, x = _pair(ctx)
    convert, _ = CONVERSIONS[name]
    out = {"rank": ctx.rank}
    with torch.no_grad():
        model(x)
        if not guarded:  # what the guard prevents: take it off and convert anyway
            for p in model.parameters():
                if type(p).__name__ == "SlotBoundParameter":
                    p.__class__ = nn.Parameter
        out["error"] = _error(lambda: convert(model))
        if not guarded:
            convert(ref)
            y = model(x)
            out["unguarded"] = str(y.device) if y.is_meta else torch.allclose(y, ref(x), atol=1e-5)
        elif out["error"] is None:
            convert(ref)
            out["equal"] = torch.equal(model(x), ref(x))
    _error(ws.close)  # unguarded, .to("meta") left weights that close() cannot rebind
    return out


@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_a_module_conversion_of_a_sharded_model_is_a_no_op_or_refused(cluster_of, name):
    words = CONVERSIONS[name][1]
    for r in cluster_of(2).run(conversion, name, True):
        if words is None:
            assert r["error"] is None and r["equal"], r["error"]
            continue
        label = "layer 0 fc1.weight" if name.startswith(("parametri", "weight_norm")) else "layer 0 q_proj.weight"
        if name == "apply data":  # the .data setter's refusal, as before
            cls, msg = r["error"]
            assert cls == ShardingError.__name__ and msg.startswith(f"{label} is a view of a weight-sharding slot")
            assert "before WeightSharding declares the model" in msg
            continue
        _refused(r["error"], r["rank"], label, words)
        assert (_FULL if "Tensor.to" not in words and "Tensor.half" not in words
                else "before WeightSharding declares the model") in r["error"][1]


@pytest.mark.parametrize("name", ["to meta", "weight_norm"])
def test_without_the_guard_those_conversions_were_silently_wrong(cluster_of, name):
    for r in cluster_of(2).run(conversion, name, False):
        assert r["error"] is None
        assert r["unguarded"] in ("meta", False), r["unguarded"]  # not the replicated model's output


# ---- 5. the weight used outside its linear ----------------------------------------------------------
def outside_its_linear(ctx):
    ref, model, ws, x = _pair(ctx)
    w, want = model.blocks[0].q_proj.weight, ref.blocks[0].q_proj.weight
    h = torch.randn(2, 48, requires_grad=True, generator=torch.Generator().manual_seed(3))
    out = {"rank": ctx.rank}
    with torch.no_grad():
        model(x)
    with raw_access():  # without the guard: another layer's bytes
        out["unguarded_equal"] = torch.equal(h @ w.t(), h @ want.t())
    out["matmul"] = _error(lambda: h @ w.t())
    out["linear"] = _error(lambda: nn.functional.linear(h, w))
    with torch.no_grad():
        out["no_grad"] = _error(lambda: h @ w.T)
    w.requires_grad_(True)  # metadata: answered; the weight is then refused wherever autograd would record it
    out["trainable_outside"] = _error(lambda: (w * w).sum())
    out["trainable_forward"] = _error(lambda: model(x))
    w.requires_grad_(False)
    with torch.no_grad():
        out["equal"] = torch.equal(model(x), ref(x))
    ws.close()
    return out


def test_a_sharded_weight_used_outside_its_linear_is_refused(cluster_of):
    for r in cluster_of(2).run(outside_its_linear):
        rank = r["rank"]
        assert not r["unguarded_equal"]  # what the guard prevents
        for what in ("matmul", "linear", "no_grad", "trainable_outside"):
            _refused(r[what], rank, "layer 0 q_proj.weight", "outside its linear's forward", "call its linear")
        cls, msg = r["trainable_forward"]
        assert cls == ShardingError.__name__ and "the weight requires grad" in msg
        assert r["equal"]


# ---- the hot path ----------------------------------------------------------------------------------
def torch_function_calls(ctx):
    ref, model, ws, x = _pair(ctx)
    cls = type(model.blocks[0].q_proj.weight)
    guard = cls.__dict__["__torch_function__"]
    calls = []

    def counting(c, func, types, args=(), kwargs=None):
        calls.append(func)
        return guard.__func__(c, func, types, args, kwargs)

    cls.__torch_function__ = classmethod(counting)
    try:
        with torch.no_grad():
            equal = torch.equal(model(x), ref(x))
        in_forward = len(calls)
        _ = model.blocks[0].q_proj.weight.shape
        outside = len(calls) - in_forward
    finally:
        cls.__torch_function__ = guard
    ws.close()
    return {"equal": equal, "in_forward": in_forward, "outside": outside}


def test_the_forward_pays_no_torch_function_call_per_op_on_a_sharded_weight(cluster_of):
    for r in cluster_of(2).run(torch_function_calls):
        assert r["equal"] and r["in_forward"] == 0 and r["outside"] == 1


# ---- 6. a block that reads its own weights directly ---------------------------------------------------
class DirectBlock(nn.Module):
    """A block whose forward uses its linears' weights directly, as real model code sometimes does
    (``F.linear(x, self.fc.weight)``, ``x @ w.t()``); ``other`` reads another block's weight."""

    def __init__(self, d: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc, self.up = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.other: nn.Linear | None = None
        self.edit = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(nn.functional.linear(x, self.fc.weight)) + x @ self.up.weight.t()
        if self.other is not None:
            h = h + x @ self.other.weight.t()
        if self.edit:
            self.fc.weight.mul_(1.0)
        return h


def direct_reads(ctx):
    from wsharding.core.runner import run_layers
    from wsharding.core.sharding import WeightSharding

    d = 32
    blocks = [DirectBlock(d, 20 + i) for i in range(4)]
    ref = copy.deepcopy(blocks)
    ws = WeightSharding(ctx.comm, blocks, {i: ["fc", "up"] for i in range(4)}).setup().finalize()
    xs = [torch.randn(3, d, generator=torch.Generator().manual_seed(10 * s + ctx.rank)) for s in range(3)]
    out = {"rank": ctx.rank}
    with torch.no_grad():
        out["steps_exact"] = all(torch.equal(run_layers(blocks, x, ws.planner), run_layers(ref, x, None)) for x in xs)
        # A block called on its own, outside the runner's step: nothing started it, so its reads are refused.
        out["alone"] = _error(lambda: blocks[2](xs[0]))
        blocks[1].other = blocks[0].fc  # layer 0's weight read inside layer 1: its slot holds layer 2 by then
        out["other_layer"] = _error(lambda: run_layers(blocks, xs[0], ws.planner))
        blocks[1].other = None
        blocks[3].edit = True  # an edit of its own weight, inside its own block
        out["edit_inside"] = _error(lambda: run_layers(blocks, xs[0], ws.planner))
        blocks[3].edit = False
        out["after_exact"] = torch.equal(run_layers(blocks, xs[1], ws.planner), run_layers(ref, xs[1], None))
    ws.close()
    return out


def test_a_block_reads_its_own_weights_directly_and_nothing_else(cluster_of):
    for r in cluster_of(2).run(direct_reads):
        rank = r["rank"]
        assert r["steps_exact"] and r["after_exact"]
        _refused(r["alone"], rank, "layer 2 fc.weight", "outside its linear's forward", _FULL)
        _refused(r["other_layer"], rank, "layer 0 fc.weight", "outside its linear's forward", _FULL)
        _refused(r["edit_inside"], rank, "layer 3 fc.weight", "Tensor.mul_ outside its linear's forward",
                 "the next gather of its layer would undo it")


def direct_reads_under_shard_blocks(ctx):
    from wsharding.core.runner import shard_blocks

    d = 32
    model = nn.Module()
    model.layers = nn.ModuleList(DirectBlock(d, 40 + i) for i in range(3))
    model.forward = lambda x: model.layers[2](model.layers[1](model.layers[0](x)))
    ref = copy.deepcopy(model.layers)
    shard_blocks(model, "layers", ["fc", "up"], ctx.shard_comm(2))
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(ctx.rank))
    with torch.no_grad():
        stepped = torch.equal(model(x), ref[2](ref[1](ref[0](x))))
        with pytest.warns(UserWarning, match="outside a step"):  # its wrapper starts it: gathered now, warned
            alone = torch.equal(model.layers[0](x), ref[0](x))  # its slot holds layer 2 after the step
    return {"stepped": stepped, "alone": alone}


def test_a_wrapped_block_called_on_its_own_reads_its_weights_after_its_gather(cluster_of):
    for r in cluster_of(2).run(direct_reads_under_shard_blocks):
        assert r["stepped"] and r["alone"]
