"""The `health` section of the config: GPU health from NVML's Xid and ECC events, each key
declared on its field (`keys`)."""

from __future__ import annotations

from dataclasses import dataclass

from deviceplugin.config.keys import Boolean, Choice, Duration, XidList, key
from deviceplugin.config.values import MIN_HANG_TIMEOUT_S, RecoveryPolicy

# Xids that an application causes (its own bad kernel, page fault, or a context it lost), not the
# GPU: they leave the GPU in service. NVIDIA k8s-device-plugin ignores the same ones.
DEFAULT_IGNORED_XIDS: tuple[int, ...] = (13, 31, 43, 45, 68, 109)
DEFAULT_RECOVERY_DELAY_S = 60.0
DEFAULT_HANG_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """GPU health checking (the `health:` section).

    An Xid is critical, and marks its GPU unhealthy, unless it is ignored: listed in
    `ignored_xids` (default: the application errors 13, 31, 43, 45, 68, 109) or in
    `additional_ignored_xids`, and not listed in `critical_xids`, which wins over both.
    A double-bit ECC event counts as Xid 48. `enabled: false` turns the Xid and ECC event watch
    off; a GPU that NVML reports lost, or whose calls hang for `hang_timeout_s`, is still marked
    unhealthy, since it cannot be measured. See RecoveryPolicy for the way back."""

    enabled: bool = key(
        "enabled",
        True,
        Boolean(),
        "Watch NVML's Xid and double-bit ECC events, and take a GPU out of service (its slices"
        " turn Unhealthy) on a critical one. A GPU that NVML reports lost, or whose NVML calls"
        " hang for hangTimeout, is taken out of service even when this is false.",
    )
    ignored_xids: tuple[int, ...] = key(
        "ignoredXids",
        DEFAULT_IGNORED_XIDS,
        XidList(),
        "Xids caused by applications, not by the GPU: they leave the GPU in service. This list"
        " replaces the default; additionalIgnoredXids adds to it; criticalXids wins over both.",
    )
    additional_ignored_xids: tuple[int, ...] = key(
        "additionalIgnoredXids", (), XidList(), "Xids to ignore on top of ignoredXids."
    )
    critical_xids: tuple[int, ...] = key(
        "criticalXids", (), XidList(), "Xids that always take a GPU out of service."
    )
    recovery: RecoveryPolicy = key(
        "recovery",
        RecoveryPolicy.MANUAL,
        Choice(RecoveryPolicy),
        "manual: a GPU taken out of service stays out until the daemon restarts; auto: it"
        " returns once it has answered correctly, with no critical Xid, for recoveryDelay.",
    )
    recovery_delay_s: float = key(
        "recoveryDelay",
        DEFAULT_RECOVERY_DELAY_S,
        Duration(),
        "Fault-free time before a GPU returns to service (recovery: auto).",
    )
    hang_timeout_s: float = key(
        "hangTimeout",
        DEFAULT_HANG_TIMEOUT_S,
        Duration(MIN_HANG_TIMEOUT_S),
        "A GPU whose NVML call hangs this long is taken out of service.",
    )

    def is_critical(self, xid: int) -> bool:
        """Whether Xid `xid` takes its GPU out of service (always False when disabled)."""
        if not self.enabled:
            return False
        if xid in self.critical_xids:
            return True
        return xid not in self.ignored_xids and xid not in self.additional_ignored_xids
