"""What the sharding asks of the linears it shards, and how it rebinds their weights.

The package's own linears follow the parallel contract of SGLang's Linear layers
(:mod:`wsharding.linear`); the sharding only needs three things of them, named here so that the
essential path does not depend on the whole contract: their parallel group decides whether they
are targets (tp size 1: the same bytes on every rank), their after-loading step runs at finalize on
the gathered full weight, and their weights are rebound without replacing the Parameter objects.
"""

from __future__ import annotations

import torch
from torch import nn


class ParallelLinear(nn.Module):
    """A linear built on a parallel group (:class:`wsharding.linear.LinearBase` derives from it).

    The declare stage decides such a module by its group: ``tp_size`` 1 -> a target, > 1 -> left
    alone (tensor parallelism already splits it); finalize runs :meth:`process_weights_after_loading`
    on the gathered full weight. Any ``nn.Linear`` is a target as it is."""

    #: The group the linear was built on (a name, or a group object), for the declare report.
    parallel_group: object = None

    @property
    def tp_size(self) -> int:
        """How many ranks split this linear (1: not split)."""
        return 1

    def process_weights_after_loading(self) -> None:
        """The quant method's step once the full weight has arrived; nothing for a plain weight."""


def rebind_tensor(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make ``layer.<name>`` read ``tensor`` (e.g. a zero-copy view of a gathered slot).

    A registered Parameter stays the same object -- its ``.data`` becomes ``tensor`` -- so
    ``model.parameters()``, ``state_dict()`` and attributes such as ``weight_loader`` keep seeing
    it; any other attribute is simply set. Quant methods read ``layer.<name>`` at call time.
    """
    param = layer._parameters.get(name)
    if param is not None:
        # Under a subclass's own ``data`` property and its ``__torch_function__`` (weight sharding guards
        # bound weights with both: [Note: reads of a bound weight]).
        with torch._C.DisableTorchFunctionSubclass():
            torch._C.TensorBase.data.__set__(param, tensor)
    else:
        setattr(layer, name, tensor)
