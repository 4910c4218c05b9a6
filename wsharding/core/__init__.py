"""The essential path of weight sharding, readable alone.

Every rank of a shard group keeps 1/N of each sharded layer's weights (its *chunk* of the layer's
flat byte buffer); one AllGather per layer rebuilds the layer into one of two *slots* just before it
computes, while the previous layer computes from the other slot. Read in this order:

1. ``layout`` -- :class:`FlatLayout`: one layer's weights as one buffer, chunk ``i`` on rank ``i``.
2. ``comm``, ``torch_backend`` -- what a group of ranks must do (gather, allocate, barrier), and
   torch.distributed doing it (gloo on CPU ranks, NCCL on GPUs).
3. ``slots`` -- the two workspaces; which layer uses which, and the gate that keeps a gather out of
   a slot still being read.
4. ``planner`` -- per step: issue layer ``i+1``'s gather, wait once at layer ``i``'s start, record its
   end (plus ``backpressure``, ``edits``, and the ``plugins`` hooks).
5. ``declare``, ``ties``, ``rowloaders`` -- which weights are targets, and reading only this rank's rows.
6. ``replicas``, ``redistribute``, ``sharding`` -- finalize: the ranks agree (layouts, and the bytes
   of weights kept as built), row shards go into chunks, weights are bound to slot views;
   ``guards``/``bound`` refuse what would silently go wrong on them; ``sharding`` also counts its bytes.
7. ``runner``, ``context`` -- the layer loop and ``shard_blocks`` around any model; a rank's context
   in a ``torchrun`` job.

Nothing here imports :mod:`wsharding.accel` (our NCCL binding, mapped slots, prefetch plug-ins) or
the teaching layer: an acceleration is an object passed in -- a communicator, a slot policy it
offers, a planner plug-in.
"""
