"""The DRA checkpoint (`<state-dir>/dra-claims.json`) planted or garbled: a FIFO, a symlink,
deep nesting, a file of 200 MB, negative memory. `serve --kubelet-api dra` reads it with the
kubelet checkpoint's bounded reader and checks every value: a bad file is moved aside (never
read whole, never followed, never blocked on), one log line says which file, why and where it
went, and the daemon starts and prepares claims. The other values out of range (NaN compute,
memory above its device's...) are tests/unit/test_dra_claims.py's, on the same code."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from deviceplugin.dra.claims import ClaimDevice, PreparedClaim
from deviceplugin.dra.store import MAX_CHECKPOINT_BYTES, claims_to_json
from tests.blackbox.daemon_harness import GiB, Node, eventually
from tests.blackbox.test_dra import GPU0, _claim, _dra, _prepare, _spec
from tests.security.dra_support import healthy, register, serving_dra
from tests.support.fake_apiserver import FakeApiServer

PRECIOUS = "not the daemon's\n"


def checkpoint(**device: object) -> str:
    """A checkpoint of one claim on GPU 0, with `device`'s values in place of the valid ones."""
    claim = PreparedClaim(
        "u-old",
        "default",
        "claim-old",
        (ClaimDevice("gpu", "gpu-0", GPU0.uuid, 0, 0, 40 * GiB, 4 * GiB, 25.0, "s"),),
        (("pod-old", "uid-pod-old"),),
        ("vgpu.dev/claim=u-old",),
    )
    claims = claims_to_json([claim])
    claims[0]["devices"][0].update(device)
    return json.dumps({"version": 1, "claims": claims})


def fifo(path: Path) -> None:
    os.mkfifo(path, 0o600)


def symlink(path: Path) -> None:
    victim = path.parent.parent / "victim"
    victim.write_text(PRECIOUS)
    path.symlink_to(victim)


def deep(path: Path) -> None:
    path.write_text('{"version": 1, "claims": ' + "[" * 200_000 + "]" * 200_000 + "}")


def huge(path: Path) -> None:
    with path.open("wb") as f:
        f.truncate(200 << 20)  # sparse: 200 MB that would be read whole


def negative_memory(path: Path) -> None:
    path.write_text(checkpoint(memory_bytes=-4 * GiB))


@pytest.mark.parametrize(
    ("plant", "problem"),
    [
        (fifo, "is not a regular file (mode p"),
        (symlink, "is a symbolic link"),
        (deep, "nested too deep"),
        (huge, f"is more than {MAX_CHECKPOINT_BYTES} bytes ({200 << 20})"),
        (negative_memory, "claims[0].devices[0].memory_bytes is -4294967296, not an integer"),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
async def test_a_bad_checkpoint_is_moved_aside_and_the_daemon_starts(
    dra_node: Node, dra_api: FakeApiServer, plant: Callable[[Path], None], problem: str
) -> None:
    state = dra_node.root / "state"
    state.mkdir(mode=0o700)
    path = state / "dra-claims.json"
    plant(path)
    kind = stat.S_IFMT(os.lstat(path).st_mode)
    settings = _dra(dra_node, dra_api)
    dra_api.put_claim(_claim("u-new", "1Gi", "10"))
    with serving_dra(dra_node, dra_api) as (proc, port):
        # Started: registered, answering its probes, preparing claims.
        await register(settings)
        await eventually(lambda: healthy(port), 20, "/healthz")
        assert (await _prepare(settings.service_socket, "u-new")).error == ""
        assert _spec(dra_node, "u-new").exists()
        assert proc.poll() is None
    log = (dra_node.root / "serve.log").read_text()
    assert "Traceback" not in log
    (line,) = [ln for ln in log.splitlines() if "DRA checkpoint is unusable" in ln]
    assert f"path={path}" in line
    assert problem in line, line
    asides = sorted(state.glob("dra-claims.json.unreadable-*"))
    assert len(asides) == 1
    assert f"moved_to={asides[0]}" in line
    # Moved as it was (a FIFO stays a FIFO, a link a link), and nothing written through it.
    assert stat.S_IFMT(os.lstat(asides[0]).st_mode) == kind
    if plant is symlink:
        assert (dra_node.root / "victim").read_text() == PRECIOUS
    # The new checkpoint holds the claim prepared since, and not the old one.
    uids = [c["uid"] for c in json.loads(path.read_text())["claims"]]
    assert uids == ["u-new"]
