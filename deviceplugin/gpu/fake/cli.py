"""`python -m deviceplugin.gpu.fake`: a state file to try the daemon on, and processes on its
fake GPUs.

`write PATH` writes two example GPUs. `run PATH [--gpu GPU] [--memory SIZE] [--sm PERCENT] --
COMMAND...` starts COMMAND, lists it on a GPU of the file while it runs (the GPU of the
`NVIDIA_VISIBLE_DEVICES` it inherits, as a container's process would be on its GPU, unless
`--gpu` names one) and takes it off the file when it ends. Started with a container's
environment (`env VGPU_ALLOCATION_ID=... NVIDIA_VISIBLE_DEVICES=... python -m ... run ...`), it is
that container's GPU process to the daemon.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType

from deviceplugin.errors import ConfigError, StateFileError
from deviceplugin.gpu.fake.state import FakeGpu, FakeProcess, FakeState
from deviceplugin.gpu.fake.statefile import read_state_file, write_state_file

EXIT_USAGE = 2


def _size(text: str) -> int:
    from deviceplugin.config.reader import parse_size  # noqa: PLC0415

    try:
        return parse_size(text)
    except (ConfigError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 6Gi or 512Mi") from e


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number from 0 to 100")
    return value


def _gpu_uuid(state: FakeState, wanted: str) -> str:
    """The UUID of the GPU or MIG device `wanted` names: an index (`<GPU index>:<MIG index>` for
    a MIG device, as deviceIDStrategy: index hands it out), a UUID, or a slice ID (`UUID::n`).
    StateFileError when the file has none such."""
    uuid = wanted.split("::", 1)[0]
    for gpu in state.gpus:
        if uuid in (gpu.uuid, str(gpu.index)):
            return gpu.uuid
        for mig_index, device in enumerate(gpu.mig_devices):
            if uuid in (device.uuid, f"{gpu.index}:{mig_index}"):
                return device.uuid
    known = ", ".join(f"{g.index} ({g.uuid})" for g in state.gpus)
    raise StateFileError(f"no GPU {wanted!r} in the state file; it has {known}")


def _with_process(gpu: FakeGpu, uuid: str, process: FakeProcess | None, pid: int) -> FakeGpu:
    """`gpu` with `pid` taken off the device `uuid` (the GPU or one of its MIG devices), then
    `process` put there when given."""

    def edit(processes: tuple[FakeProcess, ...]) -> tuple[FakeProcess, ...]:
        kept = tuple(p for p in processes if p.pid != pid)
        return (*kept, process) if process is not None else kept

    if gpu.uuid == uuid:
        return replace(gpu, processes=edit(gpu.processes))
    devices = tuple(
        replace(d, processes=edit(d.processes)) if d.uuid == uuid else d for d in gpu.mig_devices
    )
    return replace(gpu, mig_devices=devices)


def _update(path: Path, uuid: str, process: FakeProcess | None, pid: int) -> None:
    state = read_state_file(path)
    gpus = tuple(_with_process(gpu, uuid, process, pid) for gpu in state.gpus)
    write_state_file(path, FakeState(gpus=gpus))


def _run(args: argparse.Namespace) -> int:
    path: Path = args.path
    command: list[str] = args.command
    if not command:
        print("run: give the command to run after --", file=sys.stderr)
        return EXIT_USAGE
    visible = os.environ.get("NVIDIA_VISIBLE_DEVICES", "")
    wanted = args.gpu or visible.split(",", 1)[0].strip()
    if not wanted or wanted in ("all", "none", "void"):
        print(
            "run: name the GPU with --gpu (an index or a UUID), or run with the container's "
            "NVIDIA_VISIBLE_DEVICES",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        uuid = _gpu_uuid(read_state_file(path), wanted)
    except StateFileError as e:
        print(f"run: {e}", file=sys.stderr)
        return EXIT_USAGE
    child = subprocess.Popen(command)  # the user's own command, as `env` runs it

    def forward(number: int, _: FrameType | None) -> None:
        # SIGTERM whatever came: a command started in the background ignores SIGINT.
        with contextlib.suppress(ProcessLookupError):
            child.terminate()

    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, forward)
    try:
        process = FakeProcess(child.pid, args.memory, args.sm)
        _update(path, uuid, process, child.pid)
        print(f"pid {child.pid} on GPU {uuid} in {path}", file=sys.stderr, flush=True)
        return child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        with contextlib.suppress(StateFileError):
            _update(path, uuid, None, child.pid)


def _write(args: argparse.Namespace) -> int:
    from deviceplugin.gpu.examples import DEMO_GPUS  # noqa: PLC0415 (imports this package)

    args.path.parent.mkdir(parents=True, exist_ok=True)
    write_state_file(args.path, FakeState(gpus=DEMO_GPUS[:2]))
    print(f"wrote 2 fake GPUs to {args.path}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deviceplugin.gpu.fake",
        description="A fake GPU state file to try the daemon on, and processes on its GPUs.",
    )
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    write = sub.add_parser("write", help="write a state file of two example GPUs")
    write.add_argument("path", type=Path)
    run = sub.add_parser(
        "run",
        usage="%(prog)s [-h] [--gpu GPU] [--memory SIZE] [--sm PERCENT] path -- COMMAND [ARG...]",
        help="run a command as a GPU process of the state file while it runs",
    )
    run.add_argument("path", type=Path, help="the state file")
    run.add_argument(
        "--gpu",
        default="",
        help="the GPU: an index, a UUID or a slice ID (default: the first of "
        "NVIDIA_VISIBLE_DEVICES, as Allocate gave it)",
    )
    run.add_argument(
        "--memory", type=_size, default=1 << 30, help="the GPU memory it uses (default: 1Gi)"
    )
    run.add_argument(
        "--sm",
        type=_percent,
        default=50.0,
        help="the share of the GPU it asks for, 0-100 (default: 50)",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    # What follows "--" is the command, options and all.
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.command = command
    try:
        return _run(args) if args.action == "run" else _write(args)
    except (StateFileError, OSError) as e:
        print(f"{args.action}: {e}", file=sys.stderr)
        return EXIT_USAGE
