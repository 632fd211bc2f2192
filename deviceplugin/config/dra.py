"""The `dra` section of the config: the DRA driver's name and its request policies (docs/dra.md),
each key declared on its field (`keys`)."""

from __future__ import annotations

from dataclasses import dataclass

from deviceplugin.config.keys import Integer, Size, Text, key
from deviceplugin.config.values import DRIVER_NAME_PATTERN

DEFAULT_DRA_DRIVER_NAME = "vgpu.dev"
DEFAULT_DRA_MEMORY_MIN_BYTES = 256 * 1024**2
DEFAULT_DRA_MEMORY_STEP_BYTES = 256 * 1024**2
_MEMORY = ("memory", "Request policy of a device's memory.")
_COMPUTE = ("compute", "Request policy of a device's compute, in percent of the device.")


@dataclass(frozen=True, slots=True)
class DraConfig:
    """`dra`: the DRA driver's name and its request policies (docs/dra.md): what a claim may ask
    of one device's `memory` and `compute` (100 = the whole device). A default of None gives a
    claim that names no amount one slice's worth of the device (its memory / replicas, 100 /
    replicas), as `nvidia.com/vgpu: 1` gets."""

    driver_name: str = key(
        "driverName",
        DEFAULT_DRA_DRIVER_NAME,
        Text(
            "a DNS subdomain that starts with a letter",
            pattern=DRIVER_NAME_PATTERN,
            max_length=63,
        ),
        "The DRA driver's name, the vendor of the claims' CDI kind.",
    )
    memory_min_bytes: int = key(
        "min",
        DEFAULT_DRA_MEMORY_MIN_BYTES,
        Size(),
        "The smallest amount a claim gets.",
        group=_MEMORY,
    )
    memory_step_bytes: int = key(
        "step",
        DEFAULT_DRA_MEMORY_STEP_BYTES,
        Size(),
        "Amounts are rounded up to min + a multiple of this.",
        group=_MEMORY,
    )
    memory_default_bytes: int | None = key(
        "default",
        None,
        Size(),
        "What a claim naming no memory gets; absent: one slice's memory.",
        example="10Gi",
        group=_MEMORY,
    )
    compute_min: int = key(
        "min", 1, Integer(1, 100), "The smallest share a claim gets.", group=_COMPUTE
    )
    compute_step: int = key(
        "step",
        1,
        Integer(1, 100),
        "Shares are rounded up to min + a multiple of this.",
        group=_COMPUTE,
    )
    compute_default: int | None = key(
        "default",
        None,
        Integer(1, 100),
        "What a claim naming no compute gets; absent: one slice's share.",
        example="25",
        group=_COMPUTE,
    )
