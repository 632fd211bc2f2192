"""How the supervisor runs MPS, beyond the config's `mps` section: the protocol (from
`detect_protocol`), the drain's bound, the canary and the namespaces' timing."""

from __future__ import annotations

from dataclasses import dataclass, field

from deviceplugin.gpu.mps.namespaces import NamespaceTiming
from deviceplugin.gpu.mps.protocol import V2, V3


@dataclass(frozen=True, slots=True)
class MpsOptions:
    # 2 (per-slice defaults) or 3 (a server per GPU, a namespace per container).
    protocol: int = V2
    # How long a terminate may take before the GPU counts as wedged.
    drain_timeout_s: float = 10.0
    # The canary's command (deviceplugin.gpu.mps.canary.default_canary for a real GPU), or None
    # for no canary. Under MPS v2 a canary is a client of the daemon's own user, and MPS v2
    # serves one user at a time per GPU: where pods run as other users it would wait for them
    # and read as a wedge, so it is only for nodes whose MPS clients all run as one user.
    canary: tuple[str, ...] | None = None
    canary_timeout_s: float = 15.0
    # A canary on every server (v3) or GPU (v2) this often, besides one after each client that
    # left without a drain; 0: only the latter.
    canary_interval_s: float = 300.0
    namespaces: NamespaceTiming = field(default_factory=NamespaceTiming)

    def __post_init__(self) -> None:
        if self.protocol not in (V2, V3):
            raise ValueError(f"MPS protocol must be 2 or 3, got {self.protocol}")
