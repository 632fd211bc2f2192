"""The least a Python device plugin can do, as a process of its own: the yardstick of
tools/bench/bench_k8s.py on a real kubelet.

    python tools/bench/minimal_plugin.py --dir DEVICE_PLUGIN_DIR --resource NAME --devices N

Imports only grpc and the generated kubelet API; serves `minimal-<resource>.sock` in DIR,
registers with DIR/kubelet.sock, lists N healthy devices (`dev-0` ...) once, prefers the first
available IDs and answers Allocate with NVIDIA_VISIBLE_DEVICES. Runs until SIGTERM/SIGINT."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc is imported

import argparse
import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from deviceplugin.kubelet.proto import DEVICE_PLUGIN_VERSION, HEALTHY, KUBELET_SOCKET, dp, dp_grpc


class MinimalPlugin(dp_grpc.DevicePluginServicer):
    """The yardstick of both benchmarks (bench_plugin.py in-process, bench_k8s.py as this
    process): it lists its devices once, prefers the first available IDs (must-include first)
    and answers Allocate with NVIDIA_VISIBLE_DEVICES; no slicing, validation, allocation record,
    metrics or log line."""

    def __init__(self, device_ids: list[str]) -> None:
        self.device_ids = device_ids

    async def GetDevicePluginOptions(  # noqa: N802 (the kubelet's method name)
        self, request: dp.Empty, context: grpc.aio.ServicerContext
    ) -> dp.DevicePluginOptions:
        return dp.DevicePluginOptions(get_preferred_allocation_available=True)

    async def ListAndWatch(  # noqa: N802
        self, request: dp.Empty, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[dp.ListAndWatchResponse]:
        yield dp.ListAndWatchResponse(
            devices=[dp.Device(ID=i, health=HEALTHY) for i in self.device_ids]
        )
        await asyncio.Event().wait()

    async def GetPreferredAllocation(  # noqa: N802
        self, request: dp.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> dp.PreferredAllocationResponse:
        responses = []
        for req in request.container_requests:
            chosen = list(req.must_include_deviceIDs)
            for device_id in req.available_deviceIDs:
                if len(chosen) >= req.allocation_size:
                    break
                if device_id not in chosen:
                    chosen.append(device_id)
            responses.append(dp.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return dp.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(  # noqa: N802
        self, request: dp.AllocateRequest, context: grpc.aio.ServicerContext
    ) -> dp.AllocateResponse:
        return dp.AllocateResponse(
            container_responses=[
                dp.ContainerAllocateResponse(
                    envs={"NVIDIA_VISIBLE_DEVICES": ",".join(req.devices_ids)}
                )
                for req in request.container_requests
            ]
        )

    async def PreStartContainer(  # noqa: N802
        self, request: dp.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> dp.PreStartContainerResponse:
        return dp.PreStartContainerResponse()


async def serve(plugin_dir: Path, resource: str, devices: int) -> None:
    endpoint = "minimal-" + resource.replace("/", "-") + ".sock"
    socket = plugin_dir / endpoint
    socket.unlink(missing_ok=True)
    server = grpc.aio.server()
    dp_grpc.add_DevicePluginServicer_to_server(
        MinimalPlugin([f"dev-{i}" for i in range(devices)]), server
    )
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    async with grpc.aio.insecure_channel(f"unix://{plugin_dir / KUBELET_SOCKET}") as channel:
        await dp_grpc.RegistrationStub(channel).Register(
            dp.RegisterRequest(
                version=DEVICE_PLUGIN_VERSION,
                endpoint=endpoint,
                resource_name=resource,
                options=dp.DevicePluginOptions(get_preferred_allocation_available=True),
            )
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--resource", default="example.com/minimal")
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    asyncio.run(serve(args.dir, args.resource, args.devices))


if __name__ == "__main__":
    main()
