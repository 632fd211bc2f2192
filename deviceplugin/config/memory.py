"""The `memoryLimits` section of the config: how much more than its slices a device-plugin
container may use of a GPU's memory (docs/design.md §15), each key declared on its field.

A container's slices are its memory *request* (what the scheduler accounted, what it is
guaranteed); a resource listed here gives its containers a *limit* above that: `limitPerSlice`
times their slices on a GPU, never more than the GPU has. Where the GPU's driver partitions
memory the request is the soft limit and the limit the hard one; a container above its request
is the first reclaimed from under memory pressure (`enforcement.memory.pressureFreeBelow`). A DRA
claim takes its limit from its `vgpu.dev` parameters instead (docs/dra.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from deviceplugin.config.keys import Items, Size, Text, key, required
from deviceplugin.config.values import MIN_MEMORY_PER_SLICE_BYTES, RESOURCE_NAME_PATTERN


@dataclass(frozen=True, slots=True)
class ResourceMemoryLimit:
    """One resource's limit per slice."""

    resource: str = required(
        "resource",
        Text(
            "an extended resource name, <domain>/<name>",
            pattern=RESOURCE_NAME_PATTERN,
            not_pattern=r"kubernetes\.io/|^requests\.",
        ),
        "The extended resource (resourceName, or a MIG resource under the mixed strategy).",
    )
    limit_per_slice_bytes: int = required(
        "limitPerSlice",
        Size(MIN_MEMORY_PER_SLICE_BYTES),
        "The memory a container may use per slice it holds of a GPU, at least one slice's: its"
        " limit there, never above the GPU's memory (its slices stay its request).",
    )


@dataclass(frozen=True, slots=True)
class MemoryLimitsConfig:
    """`memoryLimits`: per resource, the limit above the request (see the module docstring)."""

    resources: tuple[ResourceMemoryLimit, ...] = key(
        "resources",
        (),
        Items(ResourceMemoryLimit),
        "Resources whose containers may use more memory than their slices (burst): each"
        " container's slices are its request and limitPerSlice times them its limit; a"
        " resource not listed has its limit equal to its request.",
        example="[{resource: nvidia.com/vgpu, limitPerSlice: 20Gi}]",
    )

    def limit_per_slice(self, resource: str) -> int | None:
        """The limit per slice of `resource`, None where its limit is its request."""
        for rule in self.resources:
            if rule.resource == resource:
                return rule.limit_per_slice_bytes
        return None
