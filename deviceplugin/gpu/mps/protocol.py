"""MPS v2 or v3, and the names and answers of MPS v3.

MPS v3 (driver R615 and later, CUDA 13.4) is opt-in: `nvidia-cuda-mps-control -p 3` (or
`CUDA_MPS_PROTOCOL_VERSION=3`, which wins). `detect_protocol` chooses 3 where both the driver
(major version 615 or later, when it is known) and the control command (`-p 3 -h` exits 0 and
lists the `namespace` module) offer it, and 2 otherwise. A running control daemon pins the
protocol of every later run of the control command, so one taken over is checked for it
(`process_protocol`).

Names under v3: a server per GPU, `g<12 hex digits of the SHA-256 of the GPU's UUID>`; a server
for containers that hold several GPUs, `all`; a namespace per container or claim,
`c<16 hex digits of the SHA-256 of its owner>` (an allocation ID or a claim UID). MPS takes
lowercase letters, digits and `_`, at most 64 characters. A client reaches a namespace through
`<pipe>/<server>/<namespace>/control`, a unix socket: its path must fit `sun_path` (107 bytes
and the terminating NUL).

The answers the v3 code reads: `client list` and `get_client_list` one client a line, its PID
the line's first number; `namespace list` and `server list` one name a line; `namespace get`
`key=value` lines (or `key: value`). Anything else in an answer is skipped.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass

from deviceplugin.gpu.mps.runner import ControlCommand, MpsCommandError

log = logging.getLogger(__name__)

V2 = 2
V3 = 3
# The first driver branch whose MPS speaks protocol 3.
V3_DRIVER_MAJOR = 615
ENV_PROTOCOL_VERSION = "CUDA_MPS_PROTOCOL_VERSION"
ALL_SERVER = "all"
# A unix socket path: 108 bytes with the terminating NUL.
SUN_PATH_MAX = 107
DETECT_TIMEOUT_S = 5.0
_FIRST_NUMBER = re.compile(r"\b(\d+)\b")
_NAME = re.compile(r"^[a-z0-9_]{1,64}$")


@dataclass(frozen=True, slots=True)
class Detection:
    """The protocol to run the control daemon with, and why."""

    protocol: int
    reason: str


def detect_protocol(command: ControlCommand, driver_version: str | None) -> Detection:
    """3 where the driver (when its version is known) and the control command both offer MPS
    v3; 2 otherwise. Runs `<controlCommand> -p 3 -h` (bounded); never raises."""
    if driver_version:
        try:
            major = int(driver_version.split(".")[0])
        except ValueError:
            major = None
        if major is not None and major < V3_DRIVER_MAJOR:
            return Detection(V2, f"driver {driver_version} is older than R{V3_DRIVER_MAJOR}")
    try:
        shown = command.run(["-p", "3", "-h"], None, timeout_s=DETECT_TIMEOUT_S)
    except MpsCommandError as e:
        return Detection(V2, f"the control command does not take -p 3 ({e})")
    if "namespace" not in shown:
        return Detection(V2, "the control command's -p 3 -h lists no namespace module")
    return Detection(V3, f"the control command offers protocol 3 (driver {driver_version or '?'})")


def process_protocol(argv: list[bytes], environ: list[bytes]) -> int:
    """The protocol a control daemon runs with, from its command line and environment."""
    for entry in environ:
        if entry.startswith(f"{ENV_PROTOCOL_VERSION}=".encode()):
            return V3 if entry.split(b"=", 1)[1].strip() == b"3" else V2
    for i, arg in enumerate(argv[:-1]):
        if arg == b"-p":
            return V3 if argv[i + 1] == b"3" else V2
    return V2


def server_name(gpu_uuid: str) -> str:
    return "g" + hashlib.sha256(gpu_uuid.encode()).hexdigest()[:12]


def namespace_name(owner: str) -> str:
    return "c" + hashlib.sha256(owner.encode()).hexdigest()[:16]


def valid_name(name: str) -> bool:
    return bool(_NAME.match(name))


def socket_path_fits(directory: str) -> bool:
    """Whether `<directory>/control` fits a unix socket's path."""
    return len(os.fsencode(directory)) + len(b"/control") <= SUN_PATH_MAX


def pids(answer: str) -> list[int]:
    """The PIDs of a client list: the first number of each line."""
    found: list[int] = []
    for line in answer.splitlines():
        match = _FIRST_NUMBER.search(line)
        if match is not None and int(match.group(1)) > 0:
            found.append(int(match.group(1)))
    return found


def names(answer: str) -> list[str]:
    """The names of a server or namespace list: each line that is a valid name."""
    return [line.strip() for line in answer.splitlines() if valid_name(line.strip())]


def fields(answer: str) -> dict[str, str]:
    """`key=value` or `key: value` lines, keys lower-cased, `_` and spaces as `-`."""
    found: dict[str, str] = {}
    for line in answer.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            key, sep, value = line.partition(":")
        if sep:
            found[key.strip().lower().replace("_", "-").replace(" ", "-")] = value.strip()
    return found
