"""The next step's first gather, issued during this step's last layers: a planner plug-in.

[Note: the next step's first gather]
The first sharded layer of a step has no earlier layer to hide its gather behind: on two H200s at
2048 tokens per rank it stood exposed ~0.7 ms per step. In a loop of steps the previous step's last
layers are such cover, and the draft model of SGLang's weight sharding for Kimi K3 uses that region
for its own first layer. With this plug-in attached (it is off unless asked for) the schedule of a step that runs every
sharded layer ends with the *next* step's first gather, issued when its last sharded layer starts --
or at that layer's end, when the last layer itself reads the first layer's slot -- gated on the end of
the last layer that reads that slot (:func:`wsharding.core.schedule.with_next_step_first`). The next
step finds it issued and only joins it. The rules the planner keeps for it:

* every rank issues it at the same point (the same layer range, lookahead on, untraced), so the
  collectives stay aligned;
* a layer gathered into that slot before the next step (a layer called on its own after the step)
  first joins the prefetch; the next step's first layer then finds its slot without it and is
  gathered on its own ([Note: checked at use] in ``wsharding/core/step_owner.py``);
* a CUDA graph replays alone, with nothing pending before it: no prefetch is issued under capture,
  and capturing a step that would consume one is refused (turn it off and run one eager step);
* it gathers the same slot as the draft's own first-layer prefetch, so the two are not combined.

Attach it when sharding (``shard_blocks(..., plugins=[NextStepPrefetch()])``, or
``planner.add_plugin(NextStepPrefetch())``); ``enabled`` turns it off and on between steps, on
every rank the same. The policy is the one function :meth:`NextStepPrefetch.shape`; the planner issues
and joins.
"""

from __future__ import annotations

from wsharding.core.comm import CommError
from wsharding.core.planner import WeightShardPlanner
from wsharding.core.plugins import PlannerPlugin
from wsharding.core.schedule import GatherSchedule, with_next_step_first


class NextStepPrefetch(PlannerPlugin):
    """Schedules the next step's first gather during this step's last sharded layer."""

    claims_first_layer = True

    def __init__(self, enabled: bool = True) -> None:
        #: Issue new prefetches (one already issued is still taken by the next step when False).
        self.enabled = enabled
        #: Prefetches issued, and those joined unused (the next step started past the first layer).
        self.prefetches = 0
        self.cancels = 0

    @classmethod
    def switch(cls, planner: WeightShardPlanner, on: bool) -> NextStepPrefetch | None:
        """Turn the prefetch on or off between two steps (every rank the same): attaches one the
        first time it is turned on; returns the attached plug-in, or None when there is none."""
        found = cls.attached_to(planner)
        if found is None and on:
            found = cls()
            planner.add_plugin(found)
        if found is not None:
            found.enabled = on
        return found

    def attach(self, planner: WeightShardPlanner) -> None:
        if not planner.sharded_ids:
            raise CommError("NextStepPrefetch: the planner has no sharded layer")

    def shape(self, schedule: GatherSchedule) -> GatherSchedule:
        return with_next_step_first(schedule)

    def ahead_issued(self, layer: int) -> None:
        self.prefetches += 1

    def ahead_cancelled(self, layer: int) -> None:
        self.cancels += 1
