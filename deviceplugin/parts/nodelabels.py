"""Node labels through node feature discovery's feature file (docs/design.md §11) as an optional
part: written when the config names a file, only ever in the directory the daemon was started
with; a reload that changes what the file says or where it is removes a file at an old path (its
labels would stay otherwise) and writes the new one."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from deviceplugin.config import Config
from deviceplugin.model import Inventory
from deviceplugin.nodelabels import NodeLabelFile
from deviceplugin.state import Published

log = logging.getLogger(__name__)


class NodeLabelsPart:
    """An `optional.OptionalPart`: the node feature file, when the config asks for one."""

    name = "node-labels"

    def __init__(
        self,
        config: Config,
        inventory: Published[Inventory],
        *,
        directory: Path | None,
        default_file: str = "",
        memory: Published[str] | None = None,
    ) -> None:
        self._inventory = inventory
        self._memory = memory
        # Where node labels may be written (--node-features-dir), and the file's name where
        # the config names none (--node-features-file).
        self._directory = directory
        self._default_file = default_file
        self.file = self._make(config)

    @property
    def active(self) -> bool:
        return self.file is not None

    async def start(self) -> None:
        """Nothing before the run: the file is written from the first inventory on."""

    async def run(self, stop: asyncio.Event) -> None:
        if self.file is not None:
            await self.file.run(self._inventory, stop)

    def affected(self, old: Config, new: Config) -> bool:
        return (
            new.node_labels != old.node_labels
            or new.mig.strategy != old.mig.strategy
            or new.resource_name != old.resource_name
        )

    async def replace(self, new: Config) -> None:
        old = self.file
        self.file = self._make(new)
        if old is not None and (self.file is None or self.file.path != old.path):
            await asyncio.to_thread(old.remove)

    def close(self) -> None:
        """The file stays: its labels describe the node until the next daemon writes its own."""

    def _make(self, config: Config) -> NodeLabelFile | None:
        """The feature file, only ever in the directory the daemon was started with: the
        config's nodeLabels.file, else --node-features-file (an NVIDIA file has no place for
        it)."""
        name = config.node_labels.file or self._default_file
        directory = self._directory
        if not name:
            return None
        if directory is None:
            log.error(
                "node labels are not written: the config asks for nodeLabels.file %s, but the "
                "daemon was started without --node-features-dir (VGPU_NODE_FEATURES_DIR)",
                name,
            )
            return None
        legacy = config.node_labels.legacy_directory
        if legacy and os.path.normpath(legacy) != os.path.normpath(directory):
            log.error(
                "node labels are not written: nodeLabels.path names the directory %s, but this "
                "daemon writes node labels only in its --node-features-dir %s; set "
                "nodeLabels.file: %s instead",
                legacy,
                directory,
                name,
            )
            return None
        return NodeLabelFile(
            directory,
            name,
            mig_strategy=config.mig.strategy.value,
            resource_name=config.resource_name,
            memory=self._memory,
        )
