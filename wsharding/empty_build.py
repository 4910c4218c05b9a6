"""Building a model without its weights, so that loading never holds the replicated ones.

A model built the ordinary way allocates every weight whole before :func:`~wsharding.checkpoint.load_sharded`
starts: each rank then peaks at R (every weight) although it will keep R/N -- on a GPU, the start-up
OOM the weight-sharding design warns about. Built inside :func:`empty_parameters`, every parameter is
on the meta device (shapes and dtypes, no memory); setup then allocates each sharded weight's own
rows only, and :func:`materialize` gives every other parameter real, empty memory on the rank's
device for the checkpoint to fill. The peak is then R/N + the replicated rest + one weight in flight.

Why parameters and not buffers: a buffer is usually computed in the constructor (a rotary
embedding's ``inv_freq``, a causal mask) and is not in the checkpoint, so it must be built for real;
it is small. Transformers' and accelerate's empty-weight contexts make the same choice.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

_LOCK = threading.Lock()


@contextmanager
def empty_parameters() -> Iterator[None]:
    """Inside this context, every parameter a module registers is put on the meta device (its class,
    ``requires_grad`` and attributes kept); buffers are built as usual::

        with empty_parameters():
            model = build_model()          # no weight memory
        ws = load_sharded(model, path, "model.layers", patterns, comm)

    A constructor still creates each weight before registering it (``nn.Linear`` calls
    ``torch.empty``), one at a time: ``torch.empty`` only reserves memory, and the initialisation
    that would write it runs on the meta parameter. The context patches ``nn.Module.register_parameter``
    for the whole process while it is open, so it is held by one thread at a time."""
    with _LOCK:
        register = nn.Module.register_parameter

        def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
            if param is not None and not param.is_meta:
                meta = torch.Tensor._make_subclass(type(param), param.detach().to("meta"), param.requires_grad)
                meta.__dict__.update(param.__dict__)
                param = meta
            register(self, name, param)

        nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
        try:
            yield
        finally:
            nn.Module.register_parameter = register  # type: ignore[method-assign]


def meta_parameter_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters still on the meta device (tied ones counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.is_meta)


def materialize(model: nn.Module, device: torch.device) -> int:
    """Give every parameter of ``model`` still on meta empty memory on ``device`` -- the same Parameter
    class and attributes, a tied parameter one tensor for all its places -- and move the buffers to
    ``device``. Returns the bytes allocated. Their values are undefined until a checkpoint fills them
    (:func:`~wsharding.checkpoint.load_checkpoint` refuses a checkpoint that lacks any)."""
    made: dict[int, nn.Parameter] = {}
    kept: list[nn.Parameter] = []  # the meta parameters stay alive until the end: their ids stay theirs
    allocated = 0
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in made:
                kept.append(p)
                real = torch.Tensor._make_subclass(type(p), torch.empty(p.shape, dtype=p.dtype, device=device),
                                                   p.requires_grad)
                real.__dict__.update(p.__dict__)
                made[id(p)] = real
                allocated += real.numel() * real.element_size()
            module._parameters[name] = made[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and b.device != device and not b.is_meta:
                module._buffers[name] = b.to(device)
    return allocated
