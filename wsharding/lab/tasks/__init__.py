"""Rank tasks, one module per stage: ``layout``, ``nccl``, ``planner``, ``model``, ``linear``, ``loading``.

A task takes ``ctx: RankContext`` first and returns plain picklable values; the cluster runs it on
every rank and returns the results in rank order.
"""
