"""Serving a sharded model inside an engine someone else wrote.

* :mod:`wsharding.engines.transformers_cb` -- transformers' continuous batching
  (``ContinuousBatchingManager``) on every rank of a shard group, kept aligned whatever each rank's
  requests (behind the ``hf`` extra: nothing here imports transformers until it is used).
"""
