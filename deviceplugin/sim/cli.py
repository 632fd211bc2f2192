"""The kubelet simulator's command line, `python -m deviceplugin.sim`: serve until SIGINT or
SIGTERM and admit the pods given with `--pod` once a plugin lists enough devices."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deviceplugin.sim.kubelet import KubeletSimulator
from deviceplugin.sim.records import (
    AdmissionError,
)

logger = logging.getLogger("deviceplugin.sim.kubelet")  # one name for the whole simulator

LOG_LEVELS = ("debug", "info", "warning", "error")
_POD = re.compile(r"(?:([a-z0-9][-a-z0-9]*)/)?([a-z0-9][-a-z0-9.]*):(.+)")
_CONTAINER = re.compile(r"([a-z0-9][-a-z0-9]*)=(\d+)")


@dataclass(frozen=True, slots=True)
class PodRequest:
    """A pod to admit from the command line: `--pod NAMESPACE/NAME:CONTAINER=N[,CONTAINER=N]`."""

    namespace: str
    name: str
    containers: tuple[tuple[str, int], ...]

    @property
    def devices(self) -> int:
        return sum(count for _, count in self.containers)


def parse_pod_request(text: str) -> PodRequest:
    """`default/train:trainer=2`, `train:trainer=2` (namespace default) or
    `ml/serve:api=1,sidecar=0`; ValueError naming the problem otherwise."""
    expected = "expected NAMESPACE/NAME:CONTAINER=N[,CONTAINER=N...], e.g. default/train:trainer=2"
    found = _POD.fullmatch(text.strip())
    if found is None:
        raise ValueError(f"{text!r}: {expected}")
    containers = []
    for part in found.group(3).split(","):
        container = _CONTAINER.fullmatch(part.strip())
        if container is None:
            raise ValueError(f"{text!r}: container {part!r} is not CONTAINER=N ({expected})")
        containers.append((container.group(1), int(container.group(2))))
    names = [name for name, _ in containers]
    if len(set(names)) != len(names):
        raise ValueError(f"{text!r}: a container is named twice")
    return PodRequest(found.group(1) or "default", found.group(2), tuple(containers))


def _pod_argument(text: str) -> PodRequest:
    try:
        return parse_pod_request(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return text.lower()


async def _admit_when_registered(
    kubelet: KubeletSimulator,
    pods: Sequence[PodRequest],
    resource_name: str,
    stop: asyncio.Event,
    out: Any,
) -> None:
    """Admit `pods` in order once the plugin of `resource_name` lists enough healthy devices,
    and print what each container got."""
    needed = sum(pod.devices for pod in pods)
    announced = False
    while len(kubelet.healthy_ids(resource_name)) < needed:
        if not announced:
            print(f"waiting for {needed} healthy devices of {resource_name}", file=out, flush=True)
            announced = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)
        if stop.is_set():
            return
    for pod in pods:
        try:
            grant = await kubelet.admit_pod(
                pod.name, pod.containers, resource_name=resource_name, namespace=pod.namespace
            )
        except AdmissionError as e:
            print(f"refused {pod.namespace}/{pod.name}: {e.reason}: {e.message}", file=out)
            continue
        for container in grant.containers:
            envs = " ".join(f"{k}={v}" for k, v in sorted(container.envs.items()))
            devices = ",".join(container.device_ids) or "none"
            print(
                f"admitted {pod.namespace}/{pod.name}/{container.name}: devices {devices}"
                + (f" env {envs}" if envs else ""),
                file=out,
                flush=True,
            )


async def _run(
    directory: Path,
    pod_resources_socket: Path | None,
    pods: Sequence[PodRequest] = (),
    resource_name: str = "nvidia.com/vgpu",
) -> None:
    kubelet = KubeletSimulator(directory, pod_resources_socket)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(number, stop.set)
    await kubelet.start()
    try:
        if pods:
            await _admit_when_registered(kubelet, pods, resource_name, stop, sys.stdout)
        await stop.wait()
    finally:
        await kubelet.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deviceplugin.sim",
        description="Run the kubelet simulator until SIGINT or SIGTERM: the registration "
        "server in DIR, the pod-resources API, and the pods given with --pod, admitted once "
        "a plugin has registered enough devices.",
    )
    parser.add_argument(
        "--dir", type=Path, required=True, help="the device-plugin directory (kubelet.sock)"
    )
    parser.add_argument(
        "--pod-resources-socket", type=Path, default=None, help="serve pod-resources v1 here"
    )
    parser.add_argument(
        "--pod",
        dest="pods",
        action="append",
        type=_pod_argument,
        default=[],
        metavar="NAMESPACE/NAME:CONTAINER=N",
        help="admit this pod, each container asking for N devices (repeatable; several "
        "containers: c1=1,c2=2; the namespace defaults to default)",
    )
    parser.add_argument(
        "--resource",
        default="nvidia.com/vgpu",
        help="the resource --pod asks for (default: nvidia.com/vgpu)",
    )
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default="info",
        metavar="|".join(LOG_LEVELS),
        help="the least severe lines written (default: info)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    try:
        asyncio.run(_run(args.dir, args.pod_resources_socket, args.pods, args.resource))
    except (ValueError, OSError) as e:
        logger.error("kubelet simulator failed error=%s", e)
        return 1
    return 0
