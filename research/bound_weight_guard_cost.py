"""Host time of one sharded ``nn.Linear`` forward (no_grad, CPU, 64 x 64, one thread): the price of the
guard of [Note: reads of a bound weight] (``wsharding/core/bound.py``). Prints, per call, the minimum
and the median of 31 rounds of 4000 calls for

* a plain ``nn.Linear`` (no sharding);
* the sharded linear of this tree (the forward wrapper: one grad-mode check, then the forward under
  ``torch._C.DisableTorchFunctionSubclass``, in which ``F.linear`` skips the weight's
  ``__torch_function__``);
* the design not taken: a weight whose ``__torch_function__`` reads a flag on every op (no wrapper).

Run it on the tree before a change and after (``git archive`` the old one) to see what the wrapper adds.
Run from the repository root: ``PYTHONPATH=. .venv/bin/python research/bound_weight_guard_cost.py``."""

import copy
import statistics
import timeit

import torch
from torch import nn

from tests.core.test_library_edges import Loopback, Stack
from wsharding.core.runner import shard_blocks


class FlagParameter(nn.Parameter):
    """The design not taken: ``__torch_function__`` on every op, allowed while a flag says so."""

    inside = [True]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if not cls.inside[0]:
            raise RuntimeError("outside the forward")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    model = Stack(4, 64)
    plain = copy.deepcopy(model.blocks[1].fc)
    ws = shard_blocks(model, "blocks", ["fc"], Loopback())
    flag = copy.deepcopy(plain)
    flag.weight = torch.Tensor._make_subclass(FlagParameter, plain.weight.detach(), False)
    cases = {"plain nn.Linear": plain, "sharded (this tree)": model.blocks[1].fc, "flag + __torch_function__": flag}
    x = torch.randn(1, 64)
    us: dict[str, list[float]] = {k: [] for k in cases}
    with torch.no_grad():
        for _ in range(31):
            for k, m in cases.items():
                us[k].append(timeit.timeit(lambda m=m: m(x), number=4000) / 4000 * 1e6)
    for k, v in us.items():
        print(f"{k:28s} min {min(v):6.2f} us  median {statistics.median(v):6.2f} us")
    ws.close()
