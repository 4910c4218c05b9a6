"""What a planner plug-in is: the hooks at which the planner calls something that issues a gather
outside the layer sequence."""

from __future__ import annotations

from typing import TypeVar

from wsharding.core.planner import WeightShardPlanner

P = TypeVar("P", bound="PlannerPlugin")


class PlannerPlugin:
    """Something that issues a gather outside the layer sequence, attached with
    :meth:`WeightShardPlanner.add_plugin` (the next step's first gather, a draft model's first layer:
    :mod:`wsharding.accel`). The planner calls each hook at one fixed point of a step; the defaults
    do nothing. A plug-in that gathers the first sharded layer ahead says so (``claims_first_layer``):
    two such on one planner would gather into the same slot, so the second is refused."""

    claims_first_layer = False

    @classmethod
    def attached_to(cls: type[P], planner: WeightShardPlanner) -> P | None:
        """The plug-in of this class attached to ``planner``, or None."""
        return next((p for p in planner.plugins if isinstance(p, cls)), None)

    def attach(self, planner: WeightShardPlanner) -> None:
        """Called once by :meth:`WeightShardPlanner.add_plugin`."""

    def step_start(self, planner: WeightShardPlanner, start_layer: int) -> None:
        """In ``pre_dispatch``, after the fork, before the step's first gather is issued."""

    def after_last_dispatch(self, planner: WeightShardPlanner) -> None:
        """In ``maybe_dispatch`` past the last sharded layer: the last sharded layer is starting."""

    def layer_done(self, planner: WeightShardPlanner, layer: int) -> None:
        """In ``update_done_event``, after ``layer`` ran (its end recorded)."""

    def before_regather(self, planner: WeightShardPlanner, slot: int) -> None:
        """Before a layer is gathered again into ``slot`` outside the sequence."""

    def join(self, planner: WeightShardPlanner) -> None:
        """A step given up by an exception: wait for what this plug-in issued."""

    def close(self, planner: WeightShardPlanner) -> None:
        """The sharding closes: nothing issued may write into its slots afterwards."""
