"""Pure: what a process environment claims, as the resolver (`usage.procs`) hands it to the
attribution rules (`usage.charges`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceClaims:
    """The allocation IDs one environment claims: `VGPU_ALLOCATION_ID` (`default`) and the
    per-device `VGPU_ALLOCATION_ID_<suffix>` (`devices`: (suffix, ID) sorted by suffix, the ID
    None where the value is not one Allocate sets). A container holding slices of several
    resources has one `VGPU_ALLOCATION_ID` of them all, and one per-device key per device."""

    default: str | None
    devices: tuple[tuple[str, str | None], ...]

    def on(self, suffix: str) -> str | None:
        """The claim for the device whose env suffix is `suffix` (`allocation.device_env_suffix`):
        its own key's where the environment sets one, else `default`."""
        for key, value in self.devices:
            if key == suffix:
                return value
        return self.default


# What an environment claims: no or one allocation ID for every device, or `DeviceClaims`.
Claim = str | DeviceClaims | None
