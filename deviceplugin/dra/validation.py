"""What the API server checks of a ResourceSlice before it stores it, for the slices this driver
writes: pure, an API object in, a list of field errors out (docs/dra.md, "What the node
publishes").

The API server refuses a slice as a whole when any field breaks a rule, so `serve` checks the
slice it is about to write (and a reload the slice its new config would make), and
`check-config` the slice a config makes for the GPUs it plans for. The rules mirror the
`resource.k8s.io/v1` validation of Kubernetes 1.34 to 1.36 (`validateResourceSliceSpec`,
`validateDevice`, `validateRequestPolicyRange` and the limits of its types) for the fields the
driver sets:

- the driver name: a DNS subdomain of at most 63 characters; the pool name and the node name:
  DNS subdomains; the pool's `generation` at least 0, its `resourceSliceCount` above 0;
- at most 128 devices, 64 when one of them has a taint; device names unique DNS labels;
- per device at most 32 attributes and capacities together; their names C identifiers of at
  most 32 characters; a string attribute at most 64 characters; exactly one value each;
- a capacity with a `requestPolicy` needs `allowMultipleAllocations: true`; its `validRange`
  needs `min` and `default`; `min` <= the capacity's value; `default` >= `min`; with `max`:
  `min` <= `max` <= the value and `default` <= `max`; with `step`: `min + step` <= the value,
  and `default` and `max` each `min` plus a whole number of steps;
- at most 16 taints per device, each a label-name key and the effect NoSchedule, NoExecute or
  None.

Errors read as the API server writes them: `<field path>: <what is wrong>`, the path as in the
API (`spec.devices[1].capacity[memory].requestPolicy.validRange.max`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_DEVICES = 128
MAX_DEVICES_WITH_TAINTS = 64
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ID_LENGTH = 32
MAX_STRING_VALUE_LENGTH = 64
MAX_DRIVER_NAME_LENGTH = 63
MAX_SUBDOMAIN_LENGTH = 253
MAX_LABEL_LENGTH = 63
MAX_TAINTS = 16
TAINT_EFFECTS = ("NoSchedule", "NoExecute", "None")

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_LABEL = re.compile(_LABEL)
_DNS_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_INTEGER = re.compile(r"-?[0-9]+")


@dataclass(frozen=True, slots=True)
class FieldError:
    """One rule a field breaks: its path in the object and what is wrong."""

    field: str
    detail: str

    def __str__(self) -> str:
        return f"{self.field}: {self.detail}"


def slice_errors(obj: Mapping[str, Any]) -> list[FieldError]:
    """Every rule the ResourceSlice `obj` breaks; empty when the API server would take it."""
    errors: list[FieldError] = []
    name = str((obj.get("metadata") or {}).get("name") or "")
    errors += _subdomain(name, "metadata.name")
    spec = obj.get("spec") or {}
    driver = str(spec.get("driver") or "")
    errors += _subdomain(driver, "spec.driver", MAX_DRIVER_NAME_LENGTH)
    pool = spec.get("pool") or {}
    errors += _subdomain(str(pool.get("name") or ""), "spec.pool.name")
    if int(pool.get("generation", 0)) < 0:
        errors.append(FieldError("spec.pool.generation", "must be greater than or equal to zero"))
    if int(pool.get("resourceSliceCount", 0)) <= 0:
        errors.append(FieldError("spec.pool.resourceSliceCount", "must be greater than zero"))
    errors += _subdomain(str(spec.get("nodeName") or ""), "spec.nodeName")
    devices = list(spec.get("devices") or [])
    tainted = any(d.get("taints") for d in devices)
    limit = MAX_DEVICES_WITH_TAINTS if tainted else MAX_DEVICES
    if len(devices) > limit:
        why = " when a device has a taint" if tainted else ""
        errors.append(
            FieldError("spec.devices", f"must have at most {limit} items{why}, has {len(devices)}")
        )
        return errors  # the API server checks no device past this
    seen: set[str] = set()
    for i, device in enumerate(devices):
        path = f"spec.devices[{i}]"
        errors += device_errors(device, path)
        name = str(device.get("name") or "")
        if name in seen:
            errors.append(FieldError(f"{path}.name", f"Duplicate value: {name!r}"))
        seen.add(name)
    return errors


def device_errors(device: Mapping[str, Any], path: str) -> list[FieldError]:
    """The rules one device of a slice breaks; `path` is its place, e.g. `spec.devices[0]`."""
    errors = _label(str(device.get("name") or ""), f"{path}.name")
    attributes: Mapping[str, Any] = device.get("attributes") or {}
    capacity: Mapping[str, Any] = device.get("capacity") or {}
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        errors.append(
            FieldError(
                path,
                "the total number of attributes and capacities must not exceed "
                f"{MAX_ATTRIBUTES_AND_CAPACITIES}",
            )
        )
    for key, value in attributes.items():
        errors += _identifier(key, f"{path}.attributes[{key}]")
        errors += _attribute_errors(value, f"{path}.attributes[{key}]")
    shared = device.get("allowMultipleAllocations") is True
    for key, value in capacity.items():
        where = f"{path}.capacity[{key}]"
        errors += _identifier(key, where)
        total = _quantity(value.get("value"), f"{where}.value", errors)
        policy = value.get("requestPolicy")
        if policy is None:
            continue
        if not shared:
            errors.append(
                FieldError(f"{where}.requestPolicy", "allowMultipleAllocations must be true")
            )
        elif total is not None:
            errors += request_policy_errors(total, policy, f"{where}.requestPolicy")
    taints = list(device.get("taints") or [])
    if len(taints) > MAX_TAINTS:
        errors.append(FieldError(f"{path}.taints", f"must have at most {MAX_TAINTS} items"))
    for i, taint in enumerate(taints):
        errors += _taint_errors(taint, f"{path}.taints[{i}]")
    return errors


def request_policy_errors(capacity: int, policy: Mapping[str, Any], path: str) -> list[FieldError]:
    """The rules a consumable capacity's request policy breaks, for a capacity of `capacity`.
    Only `validRange` policies (what this driver writes) are checked in full."""
    errors: list[FieldError] = []
    valid_range = policy.get("validRange")
    if valid_range is None:
        return errors
    if policy.get("validValues"):
        return [
            FieldError(
                path,
                'exactly one policy can be specified, cannot specify "validValues" and '
                '"validRange" at the same time',
            )
        ]
    where = f"{path}.validRange"
    default = _quantity(policy.get("default"), f"{path}.default", errors, required=True)
    minimum = _quantity(valid_range.get("min"), f"{where}.min", errors, required=True)
    maximum = _quantity(valid_range.get("max"), f"{where}.max", errors)
    step = _quantity(valid_range.get("step"), f"{where}.step", errors)
    if default is None or minimum is None:
        return errors
    if minimum > capacity:
        errors.append(
            FieldError(f"{where}.min", f"{minimum}: min is larger than capacity value: {capacity}")
        )
    if default < minimum:
        errors.append(FieldError(f"{where}.min", f"{default}: default is less than min: {minimum}"))
    if maximum is not None:
        if minimum > maximum:
            errors.append(
                FieldError(f"{where}.max", f"{minimum}: min is larger than max: {maximum}")
            )
        if maximum > capacity:
            errors.append(
                FieldError(
                    f"{where}.max", f"{maximum}: max is larger than capacity value: {capacity}"
                )
            )
        if default > maximum:
            errors.append(
                FieldError(f"{where}.max", f"{default}: default is more than max: {maximum}")
            )
    if step is not None:
        if step <= 0:
            errors.append(FieldError(f"{where}.step", f"{step}: must be greater than zero"))
            return errors
        if minimum + step > capacity:
            errors.append(
                FieldError(
                    f"{where}.step",
                    f"{step}: one step {minimum + step} is larger than capacity value: {capacity}",
                )
            )
        for value in (default, maximum):
            if value is not None and (value - minimum) % step:
                errors.append(
                    FieldError(
                        f"{where}.step",
                        f"{value}: value is not a multiple of a given step ({step}) from "
                        f"({minimum})",
                    )
                )
    return errors


def _quantity(
    value: object, path: str, errors: list[FieldError], *, required: bool = False
) -> int | None:
    """A quantity as this driver writes it (a whole number, in a string); None when absent or
    not one (then an error is added)."""
    if value is None:
        if required:
            errors.append(FieldError(path, "Required value"))
        return None
    if not isinstance(value, str) or not _INTEGER.fullmatch(value):
        errors.append(FieldError(path, f"{value!r}: not a quantity this driver writes"))
        return None
    return int(value)


def _attribute_errors(value: object, path: str) -> list[FieldError]:
    if not isinstance(value, Mapping) or len(value) != 1:
        return [FieldError(path, "exactly one value must be specified")]
    (kind, content), *_ = value.items()
    if kind == "string" and len(str(content)) > MAX_STRING_VALUE_LENGTH:
        return [
            FieldError(
                f"{path}.string", f"Too long: may not be more than {MAX_STRING_VALUE_LENGTH} bytes"
            )
        ]
    if kind not in ("string", "int", "bool", "version"):
        return [FieldError(path, "exactly one value must be specified")]
    return []


def _taint_errors(taint: Mapping[str, Any], path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    key = str(taint.get("key") or "")
    prefix, _, name = key.rpartition("/")
    if (
        not name
        or len(name) > MAX_LABEL_LENGTH
        or not _LABEL_NAME.fullmatch(name)
        or (prefix and _subdomain(prefix, ""))
    ):
        errors.append(FieldError(f"{path}.key", f"{key!r}: not a valid label name"))
    effect = taint.get("effect")
    if not effect:
        errors.append(FieldError(f"{path}.effect", "Required value"))
    elif effect not in TAINT_EFFECTS:
        errors.append(
            FieldError(
                f"{path}.effect",
                f"Unsupported value: {effect!r}: supported values: "
                + ", ".join(f'"{e}"' for e in TAINT_EFFECTS),
            )
        )
    return errors


def _identifier(name: str, path: str) -> list[FieldError]:
    """An unqualified attribute or capacity name: a C identifier of at most 32 characters."""
    if "/" in name:
        return []  # qualified names: this driver writes none
    if len(name) > MAX_ID_LENGTH:
        return [FieldError(path, f"Too long: may not be more than {MAX_ID_LENGTH} bytes")]
    if not _C_IDENTIFIER.fullmatch(name):
        return [FieldError(path, f"{name!r}: a C identifier must start with a letter or '_'")]
    return []


def _subdomain(name: str, path: str, limit: int = MAX_SUBDOMAIN_LENGTH) -> list[FieldError]:
    if not name:
        return [FieldError(path, "Required value")]
    if len(name) > limit:
        return [FieldError(path, f"Too long: may not be more than {limit} bytes")]
    if not _DNS_SUBDOMAIN.fullmatch(name):
        return [
            FieldError(
                path,
                f"{name!r}: a lowercase RFC 1123 subdomain must consist of lower case "
                "alphanumeric characters, '-' or '.', and must start and end with an "
                "alphanumeric character",
            )
        ]
    return []


def _label(name: str, path: str) -> list[FieldError]:
    if not name:
        return [FieldError(path, "Required value")]
    if len(name) > MAX_LABEL_LENGTH or not _DNS_LABEL.fullmatch(name):
        return [
            FieldError(
                path,
                f"{name!r}: a lowercase RFC 1123 label must consist of lower case alphanumeric "
                f"characters or '-', start and end with one, and be at most {MAX_LABEL_LENGTH} "
                "characters",
            )
        ]
    return []
