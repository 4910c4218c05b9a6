"""Communication: one small protocol (``base``), shard groups (``groups``) and backends
(``torch_backend`` over torch.distributed; ``nccl`` over our ctypes binding of libnccl)."""

from wsharding.comm.base import CommError, Communicator, DoneHandle, GatherHandle
from wsharding.comm.groups import shard_group_of, shard_group_ranks

__all__ = ["CommError", "Communicator", "DoneHandle", "GatherHandle", "shard_group_of", "shard_group_ranks"]
