"""The daemon's MPS supervisor on the fake control command, for tests: a factory that stops
every supervisor it made (quit, then its own child only) and kills every fake client."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from deviceplugin.allocation import DeviceLimits, MpsDefaults
from deviceplugin.config import MpsConfig
from deviceplugin.gpu.mps import MpsControlDaemon, MpsOptions
from tests.support.fake_mps.client import FAKE_CONTROL, FakeClient

GIB = 1 << 30
GPU_A = "GPU-00000000-0000-4000-8000-000000000000"
GPU_B = "GPU-00000000-0000-4000-8000-000000000001"
# Two GPUs of 80 GiB and 24 GiB, four slices each.
DEFAULTS = MpsDefaults(
    pinned_mem_limit_mib=((GPU_A, 20 * 1024), (GPU_B, 6 * 1024)), active_thread_percentage=25
)


def limits(uuid: str, share_percent: int, memory_gib: int) -> DeviceLimits:
    """What a container holds of one GPU."""
    total = 80 * GIB if uuid == GPU_A else 24 * GIB
    memory = memory_gib * GIB
    return DeviceLimits(uuid, memory, memory, share_percent, total)


@dataclass
class Supervisors:
    root: Path
    made: list[MpsControlDaemon] = field(default_factory=list)
    clients: list[FakeClient] = field(default_factory=list)

    def make(
        self, options: MpsOptions | None = None, *, root: Path | None = None
    ) -> MpsControlDaemon:
        config = MpsConfig(
            enabled=True, root=str(root or self.root), control_command=str(FAKE_CONTROL)
        )
        daemon = MpsControlDaemon(config, options=options, check_interval_s=0.05)
        self.made.append(daemon)
        return daemon

    def client(
        self,
        pipe_directory: str | Path,
        *,
        work: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> FakeClient:
        """A fake MPS client, killed at the end of the test."""
        client = FakeClient(pipe_directory, work=work, env=env)
        self.clients.append(client)
        return client


@contextmanager
def supervisors(root: Path) -> Iterator[Supervisors]:
    made = Supervisors(root)
    try:
        yield made
    finally:
        for client in made.clients:
            client.kill()
        for daemon in reversed(made.made):
            daemon.stop()
