"""What a planner plug-in is: a policy that changes the step's gather schedule, and nothing else.

A plug-in never touches the planner's state. It sees what a schedule is
(:class:`~wsharding.core.schedule.GatherSchedule`) and returns another one from :meth:`PlannerPlugin.shape`,
once per step range, when the planner makes its schedule; the planner replays the result and tells the
plug-in, through two notifications, what became of the gathers it added for the next step. A newcomer
who wants another policy writes one ``shape`` function.
"""

from __future__ import annotations

from typing import Any, TypeVar

from wsharding.core.errors import InvalidType
from wsharding.core.schedule import GatherSchedule

#: The planner a plug-in is attached to (:class:`~wsharding.core.planner.WeightShardPlanner`; not
#: imported here: the planner's options import this module).
WeightShardPlanner = Any
P = TypeVar("P", bound="PlannerPlugin")


class PlannerPlugin:
    """A schedule policy attached with :meth:`WeightShardPlanner.add_plugin` (the next step's first gather,
    a draft model's first layer: :mod:`wsharding.accel`). The defaults change nothing. A plug-in that
    gathers the first sharded layer ahead says so (``claims_first_layer``): two such on one planner would
    gather into the same slot, so the second is refused."""

    claims_first_layer = False
    #: Whether the gathers it adds for the next step are issued (switched between steps, every rank the same).
    enabled = True

    @classmethod
    def attached_to(cls: type[P], planner: WeightShardPlanner) -> P | None:
        """The plug-in of this class attached to ``planner``, or None."""
        return next((p for p in planner.plugins if isinstance(p, cls)), None)

    def attach(self, planner: WeightShardPlanner) -> None:
        """Called once by :meth:`WeightShardPlanner.add_plugin` (to refuse a planner it cannot serve)."""

    def shape(self, schedule: GatherSchedule) -> GatherSchedule:
        """The schedule of a step range with this policy applied."""
        return schedule

    def ahead_issued(self, layer: int) -> None:
        """A gather this policy scheduled for the next step was issued."""

    def ahead_cancelled(self, layer: int) -> None:
        """A gather issued for the next step was joined unused (the next step started past its layer)."""

    def close(self, planner: WeightShardPlanner) -> None:
        """The sharding closes (the planner has joined every gather in flight)."""


def check_plugins(plugins: object) -> list[PlannerPlugin]:
    """``plugins`` as a list when it is a list or tuple of :class:`PlannerPlugin`; else
    :class:`~wsharding.core.errors.InvalidType` naming what was given (one plug-in passed alone is
    the usual slip: ``plugins=[NextStepPrefetch()]``)."""
    if isinstance(plugins, PlannerPlugin):
        name = type(plugins).__name__
        raise InvalidType(f"plugins: expected a list of planner plug-ins, got one {name}; pass plugins=[{name}()]")
    if not isinstance(plugins, (list, tuple)):
        raise InvalidType(f"plugins: expected a list of planner plug-ins, got {type(plugins).__name__}; pass a list "
                          "such as [NextStepPrefetch()] (wsharding.core.next_step), or leave it out")
    wrong = [type(p).__name__ for p in plugins if not isinstance(p, PlannerPlugin)]
    if wrong:
        raise InvalidType(f"plugins: {', '.join(wrong)} is not a planner plug-in (a PlannerPlugin of "
                          "wsharding.core.plugins, such as NextStepPrefetch)")
    return list(plugins)
