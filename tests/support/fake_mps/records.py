"""Where the fake reads its directories, and its record: one JSON object a line in
`$CUDA_MPS_LOG_DIRECTORY/fake-control.jsonl`."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

RECORD = "fake-control.jsonl"
_lock = threading.Lock()


def directories() -> tuple[Path, Path]:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    logs = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
    return pipe, logs


def record(event: dict[str, object]) -> None:
    _, logs = directories()
    with _lock:
        logs.mkdir(parents=True, exist_ok=True)
        with (logs / RECORD).open("a", encoding="utf-8") as f:
            f.write(json.dumps({"time": time.time(), "pid": os.getpid(), **event}) + "\n")
