"""The next step's first gather, issued during this step's last layers: a planner plug-in.

[Note: the next step's first gather]
The first sharded layer of a step has no earlier layer to hide its gather behind: on two H200s at
2048 tokens per rank it stood exposed ~0.7 ms per step. In a loop of steps the previous step's last
layers are such cover, and the draft model of SGLang's weight sharding for Kimi K3 uses that region
for its own first layer. With this plug-in attached (it is off unless asked for) a step that ran every
sharded layer issues the *next* step's first gather when its last sharded layer starts, gated on
the end of the last layer that reads the same slot (held until that layer is done when it is the
running one). The next step finds it issued and only waits. The rules it keeps:

* every rank issues it at the same point (the same layer range, lookahead on, untraced), so the
  collectives stay aligned;
* a layer gathered again into that slot before the next step (a layer called on its own after the
  step) first joins the prefetch, then cancels it: the next step gathers its first layer anew;
* a CUDA graph replays alone, with nothing pending before it: no prefetch is issued under capture,
  and capturing a step that would consume one is refused (turn it off and run one eager step);
* it gathers the same slot as the draft's own first-layer prefetch, so the two are not combined.

Attach it when sharding (``shard_blocks(..., plugins=[NextStepPrefetch()])``, or
``planner.add_plugin(NextStepPrefetch())``); ``enabled`` turns it off and on between steps, on
every rank the same.
"""

from __future__ import annotations

import torch

from wsharding.core.comm import CommError
from wsharding.core.planner import WeightShardPlanner
from wsharding.core.plugins import PlannerPlugin


class NextStepPrefetch(PlannerPlugin):
    """Issues the next step's first gather when this step's last sharded layer starts."""

    claims_first_layer = True

    def __init__(self, enabled: bool = True) -> None:
        #: Issue new prefetches (one already issued is still taken by the next step when False).
        self.enabled = enabled
        #: Prefetches issued, and those cancelled by a layer gathered into their slot before the next step.
        self.prefetches = 0
        self.cancels = 0
        self._for_step = -1  # the step whose first gather was issued (or is held) early
        self._holding = False  # issued once the slot's last reader is done

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
        self.first = planner.sharded_ids[0]
        #: The last layer, in step order, that reads the first layer's slot: the prefetch may overwrite
        #: the slot once it is done. Its end is recorded every step, so that enabling the prefetch between
        #: any two steps finds a gate of this step.
        slot = planner.slot_of[self.first]
        self.wrap_gate = max(i for i in planner.sharded_ids if planner.slot_of[i] == slot)
        planner.track_done(self.wrap_gate)

    def after_last_dispatch(self, planner: WeightShardPlanner) -> None:
        """The last sharded layer starts: issue (or hold) the next step's first gather."""
        if (not self.enabled or self._for_step > planner.step or not planner.lookahead or not planner.gate
                or planner.trace is not None or planner.step_start_layer > self.first
                or planner.issued[planner.last_sharded] != planner.step
                or (planner.cuda and torch.cuda.is_current_stream_capturing())):
            return
        self._for_step = planner.step + 1
        if planner.finished[self.wrap_gate] != planner.step:
            self._holding = True  # the slot's last reader is the running layer
            return
        self._issue(planner)

    def layer_done(self, planner: WeightShardPlanner, layer: int) -> None:
        if self._holding and layer == self.wrap_gate:
            self._holding = False
            self._issue(planner)

    def _issue(self, planner: WeightShardPlanner) -> None:
        try:
            planner.gathers[self.first].start(planner.done_event(self.wrap_gate), None)
        except CommError as e:
            raise CommError(planner.stuck_message(self.first, e)) from e
        planner.issued[self.first] = planner.step + 1
        planner.slots.occupant[planner.slot_of[self.first]] = None  # receiving
        self.prefetches += 1
        planner.gathers_total += 1

    def step_start(self, planner: WeightShardPlanner, start_layer: int) -> None:
        """A step whose first gather the previous step issued: count it as this step's, or join it."""
        if self._for_step != planner.step or planner.issued[self.first] != planner.step:
            return
        if planner.cuda and torch.cuda.is_current_stream_capturing():
            raise CommError(
                f"layer {self.first}: its gather for this step was issued by the previous eager step "
                f"(NextStepPrefetch) on rank {planner.comm.rank}; a CUDA graph must hold every gather it waits "
                "on. Set enabled = False on the plug-in and run one eager step before capturing.")
        self._for_step = -1  # taken: this step's end may issue the next one
        if start_layer > self.first:  # this step does not use it: join it, so nothing is left in flight
            self._join(planner)
            return
        planner.gathers_this_step += 1

    def before_regather(self, planner: WeightShardPlanner, slot: int) -> None:
        """A gather into ``slot`` before the next step: join the prefetch into it, and let the next
        step gather its first layer anew."""
        if planner.issued[self.first] != planner.step + 1 or planner.slot_of[self.first] != slot:
            return
        self._join(planner)
        self._for_step = -1
        self.cancels += 1

    def _join(self, planner: WeightShardPlanner) -> None:
        planner.gathers[self.first].wait(planner.compute if planner.cuda else None)
        planner.issued[self.first] = -1

    def join(self, planner: WeightShardPlanner) -> None:
        # the planner waited for the issued prefetch (issued for a later step, never waited on)
        self._holding = False
        if self._for_step > planner.step:
            self._for_step = -1

    def close(self, planner: WeightShardPlanner) -> None:
        if self._for_step > planner.step and planner.issued[self.first] == planner.step + 1:
            self._join(planner)
            if planner.cuda:
                torch.cuda.synchronize(planner.device)  # nothing may write into the freed slots
        self._holding = False
