"""The one module that imports the generated kubelet API code, plus the API's constants."""

from __future__ import annotations

from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2 as dp
from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from deviceplugin._proto.podresources.v1 import api_pb2 as podres
from deviceplugin._proto.podresources.v1 import api_pb2_grpc as podres_grpc

__all__ = [
    "DEVICE_PLUGIN_VERSION",
    "HEALTHY",
    "KUBELET_SOCKET",
    "UNHEALTHY",
    "dp",
    "dp_grpc",
    "podres",
    "podres_grpc",
]

DEVICE_PLUGIN_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
DEFAULT_DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
