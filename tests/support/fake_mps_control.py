#!/usr/bin/env python3
"""A stand-in for `nvidia-cuda-mps-control`, for tests on machines without a GPU (the code is in
tests/support/fake_mps/).

It behaves like the real program where the daemon relies on it:

- `fake_mps_control.py -d` daemonises: the command returns once a background control daemon
  listens on `$CUDA_MPS_PIPE_DIRECTORY/control` and has written its PID to
  `$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid`. It refuses to start a second one.
- `fake_mps_control.py -f` is the same control daemon in the foreground: it writes its PID file,
  serves until `quit` (or `quit -t <s>`) and then exits 0.
- `fake_mps_control.py` (no argument) sends its stdin to the running control daemon, prints the
  answers and exits 0; with no control daemon running it says so on stderr and exits 1, and when
  a command is refused it prints why on stderr and exits 1.
- MPS v2 (the default): the control daemon answers `set_default_device_pinned_mem_limit <dev>
  <value>`, `get_default_device_pinned_mem_limit <dev>`, `set_default_active_thread_percentage
  <n>`, `get_default_active_thread_percentage`, `get_server_list` (its own PID while a client is
  attached: the fake's servers are threads of it), `get_client_list <server>`,
  `terminate_client <server> <client>`, and exits on `quit`, removing its PID file and sockets.
  Killed, it leaves both behind, as a crashed daemon does.
- MPS v3: `-p 3` (or `CUDA_MPS_PROTOCOL_VERSION=3`, which wins) with `-d`/`-f`, and `-m`
  (multiuser: only `--uid=0` servers); `-p 3 -h` lists the v3 modules. The control daemon then
  also answers `server create <name> [--uid=] [--allowed-devices=]`, `server set|get|list|delete
  [--force]`, `namespace create|set|get|list|delete [--force] <name> --server=<server>` (set
  with `--active-thread-percentage=`, `--pinned-memory-limit=`, `--client-priority=`; refused
  once a client is attached; delete refused while one is, unless `--force`, which terminates it;
  get prints `key=value` lines, or one field's value), `client list [--server=|--all]` (a PID a
  line), `client get <pid> pid|server|namespace|device` and `client terminate <pid>`. Names are
  lowercase letters, digits and `_`, at most 64. The pipe directory is laid out as MPS v3's:
  `$PIPE/<server>/control` (a server's default namespace) and `$PIPE/<server>/<ns>/control`
  (a namespace), each a socket of its own; `quit` removes the sockets, not the directories.
- Clients (tests/support/fake_mps/client.py): `fake_mps_control.py client [--work]` attaches
  to `$CUDA_MPS_PIPE_DIRECTORY/control` (its PID is read from the socket's peer credentials, as
  MPS does) and is held to the namespace's limits or lower ones its environment asks for;
  `--work` puts GPU work in flight. `fake_mps_control.py canary` attaches and detaches. A client
  whose connection closes without `detach`, with work in flight and not terminated first (it
  was killed), wedges the GPUs of its server: every later client of them hangs in its attach
  (the canary too), attached ones get `illegal-address`, until the control daemon is started
  again. A terminate waits while the client is stopped (SIGSTOP), and forever with the marker
  `fake-terminate-hangs`.

Everything is recorded, one JSON object a line, in `$CUDA_MPS_LOG_DIRECTORY/fake-control.jsonl`:
each run's argv, pid and CUDA_MPS_* environment (`"event": "run"`), each command the control
daemon receives (`"event": "command"`), each client attached, detached or lost (with whether it
was terminated first and had work in flight), each terminate (with whether the client was
stopped then). Tests make it fail on purpose with marker files in the MPS root (the pipe
directory's parent): `fake-fail-start` (`-d` exits 1), `fake-fail-commands` (the control daemon
answers every command with an error, exit 1), `fake-v2-only` (an older driver: `-p 3` is
refused). Others model misbehaving control programs: `fake-flood` (a command run prints 400 MiB
and more until it is killed), `fake-ignore-quit` (the control daemon answers `quit` but runs
on) and `fake-ignore-sigterm` (it ignores SIGTERM; only SIGKILL ends it).
Standard library only: it runs under whatever `python3` is on PATH.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

# Run as a script: the repository root, so that the package below is found.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.fake_mps.cli import main

if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main(sys.argv[1:]))
