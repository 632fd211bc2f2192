"""Pure: what the poll loop built from its last poll, kept so that an unchanged input costs
nothing to rebuild.

A node's GPUs and their health seldom change, yet the poll loop turns every reading into the slice
inventory, twice a second. Rebuilding it makes hundreds of objects on a full node (one per slice),
and publishing a new but equal inventory costs a comparison slice by slice; the same inventory
object, reused, is neither rebuilt nor compared again.
"""

from __future__ import annotations

from deviceplugin.config import DEFAULT_RESOURCE_NAME, MigConfig, SlicingConfig
from deviceplugin.model import GpuInfo, Inventory, NodeReading
from deviceplugin.slicing import build_inventory

_InventoryKey = tuple[SlicingConfig, MigConfig | None, str, tuple[tuple[GpuInfo, bool], ...]]


class InventoryCache:
    """`build_inventory`, remembered: the same Inventory object for as long as the slicing and
    MIG config, the resource name and every GPU's (and MIG device's) facts and health stay
    equal, a new one when any of them changes."""

    def __init__(self) -> None:
        self._key: _InventoryKey | None = None
        self._inventory = Inventory()
        self.builds = 0

    def build(
        self,
        reading: NodeReading,
        cfg: SlicingConfig,
        *,
        mig: MigConfig | None = None,
        resource_name: str = DEFAULT_RESOURCE_NAME,
    ) -> Inventory:
        # What build_inventory reads of the reading, and nothing else: each GPU's facts and health.
        key = (cfg, mig, resource_name, tuple((g.info, g.healthy) for g in reading.gpus))
        if key != self._key:
            self._inventory = build_inventory(reading, cfg, mig=mig, resource_name=resource_name)
            self._key = key
            self.builds += 1
        return self._inventory
