"""Pure: a process's allocation tags, as the resolver (`usage.procs`) reads them from its
environment and hands them to the attribution rules (`usage.charges`).

An allocation tag is the allocation ID an environment names (`VGPU_ALLOCATION_ID`, or a
per-device `VGPU_ALLOCATION_ID_<suffix>`): what a process says it belongs to, which any process
can say, so the rules check it before it counts (docs/design.md §12). It is no DRA claim."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceTags:
    """The allocation tags of one environment: `VGPU_ALLOCATION_ID` (`default`) and the
    per-device `VGPU_ALLOCATION_ID_<suffix>` (`devices`: (suffix, ID) sorted by suffix, the ID
    None where the value is not one Allocate sets). A container holding slices of several
    resources has one `VGPU_ALLOCATION_ID` of them all, and one per-device key per device."""

    default: str | None
    devices: tuple[tuple[str, str | None], ...]

    def on(self, suffix: str) -> str | None:
        """The tag for the device whose env suffix is `suffix` (`allocation.device_env_suffix`):
        its own key's where the environment sets one, else `default`."""
        for key, value in self.devices:
            if key == suffix:
                return value
        return self.default


# An environment's tag: no or one allocation ID for every device, or `DeviceTags`.
Tag = str | DeviceTags | None
