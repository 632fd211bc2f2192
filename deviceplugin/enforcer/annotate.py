"""The snapshot the enforcer publishes: each container's usage with its duty cycle, stopped time
and entitlement filled in. A container whose usage object and figures are those of the last
poll gets the very annotated object of the last poll (most containers, most polls)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import fields, replace
from operator import attrgetter

from deviceplugin.enforcer.decisions import ContainerKey
from deviceplugin.model import ContainerUsage, EnforcementCount, NodeSnapshot

# ContainerUsage's fields in order, read at once; and where the enforcer's three go among them.
# Every container of every snapshot is copied with them filled in: a positional constructor call
# costs about half of dataclasses.replace, which looks the fields up again on every call.
_USAGE_FIELDS = tuple(f.name for f in fields(ContainerUsage))
_usage_values = attrgetter(*_USAGE_FIELDS)
_DUTY = _USAGE_FIELDS.index("duty_cycle_ratio")
_STOPPED = _USAGE_FIELDS.index("throttled_seconds_total")
_ENTITLEMENT = _USAGE_FIELDS.index("entitlement_ratio")
_NOT_THROTTLED: tuple[float | None, float] = (None, 0.0)


def _annotated(
    c: ContainerUsage, duty: float | None, stopped_s: float, entitlement: float | None
) -> ContainerUsage:
    """`c` with the enforcement fields set (dataclasses.replace, faster)."""
    values = list(_usage_values(c))
    values[_DUTY] = duty
    values[_STOPPED] = stopped_s
    values[_ENTITLEMENT] = entitlement
    return ContainerUsage(*values)


class Annotator:
    """Fills in the enforcement fields of every snapshot's containers, reusing last poll's."""

    def __init__(self) -> None:
        # The last poll's annotated usage per container, with what it was made from: handed out
        # again while the snapshot builder hands out the same usage and the figures are equal.
        self._annotations: dict[
            ContainerKey, tuple[ContainerUsage, float | None, float, float | None, ContainerUsage]
        ] = {}
        # The last poll's (containers, duty-cycle figures, policy revision), and the annotated
        # containers made from them.
        self._annotated: tuple[tuple[object, ...], tuple[ContainerUsage, ...]] | None = None

    def annotate(
        self,
        snapshot: NodeSnapshot,
        figures: Mapping[Hashable, tuple[float | None, float]],
        entitlement: Callable[[ContainerKey], float | None],
        revision: int,
        enforcement: tuple[EnforcementCount, ...],
        *,
        signals_not_sent: tuple[tuple[str, int], ...] = (),
    ) -> NodeSnapshot:
        """`snapshot` with each container's duty cycle, stopped time and entitlement filled in,
        and the enforcement counts (and the signals not sent)."""
        # The same containers, duty cycles and policy state as last time (a steady node): the
        # same annotated containers.
        inputs = (snapshot.containers, figures, revision)
        if self._annotated is not None and self._annotated[0] == inputs:
            return replace(
                snapshot,
                containers=self._annotated[1],
                enforcement=enforcement,
                signals_not_sent=signals_not_sent,
            )
        previous = self._annotations
        annotations: dict[
            ContainerKey, tuple[ContainerUsage, float | None, float, float | None, ContainerUsage]
        ] = {}
        containers: list[ContainerUsage] = []
        for c in snapshot.containers:
            key = (c.allocation_id, c.gpu_uuid)
            duty, stopped_s = figures.get(key, _NOT_THROTTLED)
            entitled = entitlement(key)
            kept = previous.get(key)
            if (
                kept is not None
                and kept[0] is c
                and kept[1] == duty
                and kept[2] == stopped_s
                and kept[3] == entitled
            ):
                annotated = kept[4]
            else:
                annotated = _annotated(c, duty, stopped_s, entitled)
            annotations[key] = (c, duty, stopped_s, entitled, annotated)
            containers.append(annotated)
        self._annotations = annotations
        self._annotated = (inputs, tuple(containers))
        return replace(
            snapshot,
            containers=self._annotated[1],
            enforcement=enforcement,
            signals_not_sent=signals_not_sent,
        )
