"""gRPC client channels to the kubelet's local unix sockets (registration, pod-resources)."""

from __future__ import annotations

from pathlib import Path

import grpc

# No retries or keepalive pings of gRPC's own (a failed call is asked again by the caller's own
# loop), so that a channel kept between refreshes costs nothing while it waits. Subchannels of its
# own: gRPC's global pool hands a new channel the subchannel of a closed one, still in its
# reconnect backoff after the kubelet's socket went away, and a call on the new channel then
# fails at once with that old "No such file or directory" although the kubelet is back.
CHANNEL_OPTIONS = (
    ("grpc.enable_retries", 0),
    ("grpc.keepalive_time_ms", 2**31 - 1),
    ("grpc.use_local_subchannel_pool", 1),
)


def local_channel(socket: Path) -> grpc.aio.Channel:
    """A channel to the unix socket `socket`, with CHANNEL_OPTIONS."""
    return grpc.aio.insecure_channel(f"unix://{socket}", options=CHANNEL_OPTIONS)
