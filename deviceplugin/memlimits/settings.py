"""What the memory-limit parts are started with (docs/design.md §15)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deviceplugin.memlimits.cdihook import DEFAULT_HOOK_PATH, DEFAULT_SOCKET, HookCommand

# Where CDI specs are read by the runtime (the DRA driver's default too).
DEFAULT_CDI_DIR = "/var/run/cdi"


@dataclass(frozen=True, slots=True)
class MemoryLimitSettings:
    """GPU memory limits the driver enforces (docs/design.md §15): where the runtime hook's
    socket is served, the hook's path on the host (what the CDI specs name), and where the
    device plugins write the specs that carry it."""

    socket: Path = DEFAULT_SOCKET
    hook_path: str = DEFAULT_HOOK_PATH
    cdi_dir: Path = Path(DEFAULT_CDI_DIR)

    @property
    def command(self) -> HookCommand:
        return HookCommand(self.hook_path, self.socket)
