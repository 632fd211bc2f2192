"""Pure: what the poll loop built from its last poll, kept so that an unchanged input costs
nothing to rebuild.

A node's GPUs and their health seldom change, yet the poll loop turns every reading into the slice
inventory, twice a second. Rebuilding it makes hundreds of objects on a full node (one per slice),
and publishing a new but equal inventory costs a comparison slice by slice; the same inventory
object, reused, is neither rebuilt nor compared again.
"""

from __future__ import annotations

from deviceplugin.config import SlicingConfig
from deviceplugin.model import GpuInfo, Inventory, NodeReading
from deviceplugin.slicing import build_inventory

_InventoryKey = tuple[SlicingConfig, tuple[tuple[GpuInfo, bool], ...]]


class InventoryCache:
    """`build_inventory`, remembered: the same Inventory object for as long as the slicing config
    and every GPU's facts and health stay equal, a new one when any of them changes."""

    def __init__(self) -> None:
        self._key: _InventoryKey | None = None
        self._inventory = Inventory()
        self.builds = 0

    def build(self, reading: NodeReading, cfg: SlicingConfig) -> Inventory:
        # What build_inventory reads of the reading, and nothing else: each GPU's facts and health.
        key = (cfg, tuple((g.info, g.healthy) for g in reading.gpus))
        if key != self._key:
            self._inventory = build_inventory(reading, cfg)
            self._key = key
            self.builds += 1
        return self._inventory
