"""After finalize a sharded weight is a view of a gather slot that the next layers' gathers overwrite.
Four ordinary uses of such a weight gave silently wrong results; each is now either correct or a
clear error on every rank that names the weight and the rank and says what to do:

* autograd through a sharded weight (its backward would read a slot other layers have overwritten)
  is refused at the forward that would record it;
* an in-place edit of a sharded weight (the next gather would undo it) is refused at once between
  steps, and, made inside a forward (through the weight or its ``.data``), at the layer's next gather
  and by ``full_state_dict``;
* ``state_dict()`` (slot bytes of whichever layer was gathered last; zero-element weights after
  ``close()``) is refused and points to ``WeightSharding.full_state_dict``, which stays exact;
* ``save_checkpoint`` of a sharded model says at once, on the rank that calls it and without any
  collective, how to save it; that recipe loads back bit for bit.

Two CPU ranks (gloo), a small GPT whose every block linear is sharded.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.core.gpt_blocks import TinyGPT
from wsharding.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from wsharding.core.runner import shard_blocks
from wsharding.core.sharding import ShardingError

PATTERNS = ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"]


def _pair(ctx, prepare=None):
    """The replicated model and its sharded twin (the same weights on every rank); ``prepare(model)``,
    when given, changes both before the sharding."""
    torch.manual_seed(0)
    ref = TinyGPT().eval()
    model = copy.deepcopy(ref)
    for m in (ref, model) if prepare is not None else ():
        prepare(m)
    ws = shard_blocks(model, "blocks", PATTERNS, ctx.comm)
    x = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(ctx.rank))
    return ref, model, ws, x


def _error(call) -> tuple[str, str] | None:
    """``(class name, message)`` of what ``call()`` raised, or None when it returned."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the class and text are what the tests check
        return type(e).__name__, str(e)
    return None


# ---- autograd ------------------------------------------------------------------------------------
def autograd_through_sharded_weights(ctx):
    ref, model, ws, x = _pair(ctx)
    out = {"rank": ctx.rank,
           "requires_grad": sorted({t.module.weight.requires_grad for ts in ws.targets.values() for t in ts})}

    def train_step():
        model(x).sum().backward()
        ref(x).sum().backward()
        # without the guard: the gradients of the first layers differ from the replicated model's
        out["grad_diff"] = float((model.embed.weight.grad - ref.embed.weight.grad).abs().max())

    out["backward"] = _error(train_step)
    with torch.no_grad():  # the model is still usable, and exact, after the refusal
        out["no_grad_equal"] = torch.equal(model(x), ref(x))
    with torch.inference_mode():
        out["inference_mode_equal"] = torch.equal(model(x), ref(x))
    # grad mode on, but nothing that would be recorded: a plain forward runs and is exact
    model.requires_grad_(False)
    ref.requires_grad_(False)
    out["plain_equal"] = torch.equal(model(x), ref(x))
    # a sharded weight someone made trainable again: its forward under grad mode is refused too
    model.blocks[2].fc1.weight.requires_grad_(True)
    out["trainable"] = _error(lambda: model(x))
    with torch.no_grad():
        out["after_equal"] = torch.equal(model(x), ref(x))
    ws.close()
    return out


def test_autograd_through_sharded_weights_is_refused_at_the_forward(cluster_of):
    for r in cluster_of(2).run(autograd_through_sharded_weights):
        rank = r["rank"]
        assert r["backward"] is not None, f"backward ran, gradients off by {r.get('grad_diff')}"
        assert r["requires_grad"] == [False]
        cls, msg = r["backward"]
        assert cls == ShardingError.__name__
        assert msg.startswith(f"layer 0 q_proj.weight on rank {rank}: autograd would record")
        assert "its input requires grad" in msg
        assert "torch.no_grad()" in msg and "torch.inference_mode()" in msg and "unsharded model" in msg
        cls, msg = r["trainable"]
        assert cls == ShardingError.__name__
        assert msg.startswith(f"layer 2 fc1.weight on rank {rank}: autograd would record")
        assert "the weight requires grad" in msg
        assert r["no_grad_equal"] and r["inference_mode_equal"] and r["plain_equal"] and r["after_equal"]


# ---- in-place edits --------------------------------------------------------------------------------
def in_place_edit(ctx, via: str):
    pending: set[int] = set()

    def prepare(m):  # layer 1's q_proj edits its own weight in its forward, once asked (through ``via``)
        lin = m.blocks[1].q_proj

        def forward(h):
            if id(m) in pending:
                pending.discard(id(m))
                (lin.weight.data if via == "data" else lin.weight).mul_(2)
            return F.linear(h, lin.weight, lin.bias)

        lin.forward = forward

    ref, model, ws, x = _pair(ctx, prepare)
    out = {"rank": ctx.rank}
    w = model.blocks[1].q_proj.weight
    with torch.no_grad():
        model(x)
        # between steps: refused at once, through the weight or its .data, and nothing changed
        out["outside"] = _error(lambda: w.mul_(2))
        out["outside_data"] = _error(lambda: w.data.mul_(2))
        out["unchanged"] = torch.equal(model(x), ref(x))
        pending.update((id(model), id(ref)))
        out["edit_step"] = torch.equal(model(x), ref(x))  # the step that edits computes with the edit

        def step():
            y = model(x)
            # without the guard: the edit is undone by the gather and the output ignores it (through
            # torch's own .data, whose fresh version counter the wait's check would not see)
            out["equal_to_edited"] = torch.equal(y, ref(x))

        out["forward"] = _error(step)
        out["again"] = _error(lambda: model(x))  # refused for good, not only once
    out["full_state_dict"] = _error(lambda: ws.full_state_dict(model))
    ws.close()
    return out


@pytest.mark.parametrize("via", ["weight", "data"])
def test_an_in_place_edit_is_refused_at_once_between_steps_and_inside_a_forward_at_the_next_gather(cluster_of, via):
    for r in cluster_of(2).run(in_place_edit, via):
        rank = r["rank"]
        for what in ("outside", "outside_data"):
            cls, msg = r[what]
            assert cls == ShardingError.__name__, (what, msg)
            assert msg.startswith(f"layer 1 q_proj.weight on rank {rank}: Tensor.mul_ outside its linear's forward")
            assert "the edit would land in those bytes" in msg and "WeightSharding.full_state_dict(model)" in msg
        assert r["unchanged"] and r["edit_step"]
        assert r["forward"] is not None, f"the edited model ran (equal to the edited one: {r['equal_to_edited']})"
        for what in ("forward", "again", "full_state_dict"):
            cls, msg = r[what]
            assert cls == ShardingError.__name__, (what, msg)
            assert f"layer 1 q_proj.weight on rank {rank} was changed in place after finalize" in msg, (what, msg)
            assert "before finalize" in msg and "full_state_dict" in msg, (what, msg)


# ---- state_dict ------------------------------------------------------------------------------------
def state_dict_of_sharded_model(ctx):
    ref, model, ws, x = _pair(ctx)
    out = {"rank": ctx.rank}
    want = ref.state_dict()

    def read(what: str):
        sd = model.state_dict()
        # without the guard: slot bytes of whichever layer was gathered last; after close, empty weights
        out[f"wrong_{what}"] = sum(not torch.equal(sd[k], want[k]) for k in want)

    with torch.no_grad():
        model(x)
    out["state_dict"] = _error(lambda: read("state_dict"))
    full = ws.full_state_dict(model)
    out["full_keys"] = list(full) == list(want)
    out["full_exact"] = all(torch.equal(full[k], want[k]) for k in want)
    out["load"] = _error(lambda: model.load_state_dict(want))
    with torch.no_grad():
        out["equal"] = torch.equal(model(x), ref(x))
    ws.close()
    out["closed"] = _error(lambda: read("closed"))
    return out


def test_state_dict_of_a_sharded_model_is_refused_and_full_state_dict_is_exact(cluster_of):
    for r in cluster_of(2).run(state_dict_of_sharded_model):
        rank = r["rank"]
        assert r["state_dict"] is not None, f"state_dict() returned {r.get('wrong_state_dict')} wrong weights"
        cls, msg = r["state_dict"]
        assert cls == ShardingError.__name__
        assert msg.startswith(f"state_dict: blocks.0.q_proj.weight (layer 0 q_proj.weight) on rank {rank} is sharded")
        assert "WeightSharding.full_state_dict(model)" in msg and "every rank" in msg
        assert r["full_keys"] and r["full_exact"]
        cls, msg = r["load"]
        assert cls == ShardingError.__name__ and "load_state_dict: blocks.0.q_proj.weight" in msg
        assert r["equal"]
        assert r["closed"] is not None, f"state_dict() after close returned {r.get('wrong_closed')} wrong weights"
        cls, msg = r["closed"]
        assert cls == ShardingError.__name__
        assert msg.startswith(f"state_dict: blocks.0.q_proj.weight (layer 0 q_proj.weight) on rank {rank}: "
                              "its weight sharding was closed")
        assert "before close()" in msg


# ---- save_checkpoint -------------------------------------------------------------------------------
def _collectives_issued() -> int:
    """Collectives this rank has issued so far, over every process group it is in: each one (a
    barrier, a gather, on any group) moves its group's sequence number by one."""
    return sum(pg._get_sequence_number_for_group() for pg in dist.distributed_c10d._world.pg_map)


def save_sharded(ctx, folder: str):
    ref, model, ws, x = _pair(ctx)
    out = {"rank": ctx.rank}
    path = f"{folder}/gpt.safetensors"
    with torch.no_grad():
        model(x)
    if ctx.rank == 0:  # the usual "only rank 0 writes": rank 1 calls nothing, so nothing may wait on it
        before = _collectives_issued()
        out["plain"] = _error(lambda: save_checkpoint(model, path))
        out["plain_collectives"] = _collectives_issued() - before
        out["plain_wrote"] = os.path.exists(path)
    before = _collectives_issued()
    ctx.comm.barrier()
    out["barrier_collectives"] = _collectives_issued() - before  # the count sees a collective: 1
    by_layer = ws.full_state_dict()  # keyed by layer id: not the model's parameter names
    if ctx.rank == 1:
        out["wrong_keys"] = _error(lambda: save_checkpoint(model, path, state_dict=by_layer))
    full = ws.full_state_dict(model)  # the recipe: gathered on every rank, written on one
    if ctx.rank == 0:
        save_checkpoint(model, path, state_dict=full)
    ctx.comm.barrier()
    torch.manual_seed(123)
    fresh = TinyGPT()
    load_checkpoint(fresh, path)
    want = ref.state_dict()
    out["round_trip"] = all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())
    ws.close()
    out["closed"] = _error(lambda: save_checkpoint(model, f"{folder}/closed{ctx.rank}.safetensors"))
    return out


def test_save_checkpoint_of_a_sharded_model_says_how_at_once_and_the_recipe_round_trips(cluster_of, tmp_path):
    r0, r1 = cluster_of(2).run(save_sharded, str(tmp_path))
    cls, msg = r0["plain"]
    assert cls == CheckpointError.__name__, msg
    assert msg.startswith("save_checkpoint: blocks.0.q_proj.weight (layer 0 q_proj.weight) is sharded: on rank 0")
    assert "ws.full_state_dict(model)" in msg and "every rank" in msg and "state_dict=full" in msg
    # raised at once: no collective issued (rank 1 joins none, so one would wait for it), nothing written
    assert r0["plain_collectives"] == 0 and not r0["plain_wrote"]
    assert r0["barrier_collectives"] == r1["barrier_collectives"] == 1
    cls, msg = r1["wrong_keys"]
    assert cls == CheckpointError.__name__
    assert msg.startswith("save_checkpoint: blocks.0.q_proj.weight (layer 0 q_proj.weight) is sharded: on rank 1")
    assert "state_dict has no 'blocks.0.q_proj.weight'" in msg
    for r in (r0, r1):
        assert r["round_trip"]
        cls, msg = r["closed"]
        assert cls == CheckpointError.__name__
        assert f"on rank {r['rank']} its weight sharding was closed" in msg and "before close()" in msg
