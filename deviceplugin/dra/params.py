"""A claim's `vgpu.dev` parameters (docs/dra.md, "Memory limits"): the opaque configuration a
ResourceClaim or its DeviceClass gives the driver, read from the claim's allocation (pure).

The scheduler copies the DeviceClass's configuration (`source: FromClass`) and the claim's own
(`FromClaim`) into `status.allocation.devices.config`; each entry names the requests it applies
to (none: all of them) and, for this driver, an opaque object:

    apiVersion: vgpu.dev/v1alpha1     (<driver name>/v1alpha1)
    kind: GpuConfig
    memoryLimit: 24Gi                 (optional) what each device of the request may use

The memory a claim consumed is its request (what the scheduler accounts, what it is
guaranteed); `memoryLimit` is its limit on each device of the requests it applies to, at least
the memory consumed there and at most the device's memory. The claim's own configuration wins
over its class's; of two entries of one source, the later. Anything else (an unknown key or
kind, a limit below the request or above the device) fails the claim's Prepare, naming the
claim, the entry and what is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from decimal import Decimal
from typing import Any

from deviceplugin.dra.claims import ClaimDevice, ClaimError, PreparedClaim, parse_quantity
from deviceplugin.dra.refs import shown

API_VERSION = "v1alpha1"
KIND = "GpuConfig"
KEYS = ("apiVersion", "kind", "memoryLimit")
# The claim's own configuration is applied after its class's, so that it wins.
_ORDER = {"FromClass": 0, "FromClaim": 1}


def _applies(entry: Mapping[str, Any], request: str) -> bool:
    names = entry.get("requests") or []
    # A subrequest's result ("gpu/small") is its request's ("gpu") too.
    return not names or request in names or request.split("/", 1)[0] in names


def _parameters(label: str, where: str, parameters: object, driver_name: str) -> Decimal | None:
    """The memoryLimit of one entry's parameters, None where it sets none."""
    if not isinstance(parameters, Mapping):
        raise ClaimError(f"{label}: {where}: the parameters are not an object")
    unknown = sorted(str(k) for k in parameters if k not in KEYS)
    if unknown:
        raise ClaimError(
            f"{label}: {where}: unknown parameter {shown(unknown[0])} (known: {', '.join(KEYS)})"
        )
    version = f"{driver_name}/{API_VERSION}"
    if parameters.get("apiVersion") != version or parameters.get("kind") != KIND:
        raise ClaimError(
            f"{label}: {where}: expected apiVersion {version} and kind {KIND}, got "
            f"{shown(parameters.get('apiVersion'))} and {shown(parameters.get('kind'))}"
        )
    raw = parameters.get("memoryLimit")
    if raw is None:
        return None
    try:
        return parse_quantity(raw if isinstance(raw, str) else str(raw))
    except ValueError as e:
        raise ClaimError(f"{label}: {where}: memoryLimit {e}") from None


def requested_limits(
    claim: Mapping[str, Any], label: str, driver_name: str
) -> list[tuple[Mapping[str, Any], str, Decimal]]:
    """(entry, where, memory limit) of each of the claim's configuration entries for this
    driver that sets a memory limit, the class's before the claim's."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    config = (allocation.get("devices") or {}).get("config") or []
    if not isinstance(config, Sequence):
        raise ClaimError(f"{label}: the allocation's device config is not a list")
    found: list[tuple[int, int, Mapping[str, Any], str, Decimal]] = []
    for n, entry in enumerate(config):
        opaque = entry.get("opaque") if isinstance(entry, Mapping) else None
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver_name:
            continue
        source = str(entry.get("source") or "")
        where = f"config[{n}] ({source or 'no source'})"
        limit = _parameters(label, where, opaque.get("parameters"), driver_name)
        if limit is not None:
            found.append((_ORDER.get(source, 1), n, entry, where, limit))
    found.sort(key=lambda item: (item[0], item[1]))
    return [(entry, where, limit) for _, _, entry, where, limit in found]


def _limited(label: str, device: ClaimDevice, where: str, limit: Decimal) -> ClaimDevice:
    if limit < device.memory_bytes:
        raise ClaimError(
            f"{label}: {where}: memoryLimit {limit} bytes is below the {device.memory_bytes} "
            f"bytes the claim consumed of device {device.device} (its request)"
        )
    if limit > device.memory_total_bytes:
        raise ClaimError(
            f"{label}: {where}: memoryLimit {limit} bytes is more than device {device.device} "
            f"has ({device.memory_total_bytes} bytes)"
        )
    return replace(device, memory_limit_bytes=math.ceil(limit))


def with_memory_limits(
    prepared: PreparedClaim, claim: Mapping[str, Any], driver_name: str
) -> PreparedClaim:
    """The prepared claim with each device's memory limit from its parameters. Raises
    ClaimError naming what is wrong."""
    label = f"ResourceClaim {prepared.namespace}/{prepared.name}"
    entries = requested_limits(claim, label, driver_name)
    if not entries:
        return prepared
    devices: list[ClaimDevice] = []
    for device in prepared.devices:
        limited = device
        for entry, where, limit in entries:
            if _applies(entry, device.request):
                limited = _limited(label, device, where, limit)
        devices.append(limited)
    return replace(prepared, devices=tuple(devices))
