"""The kubelet-facing side: the DevicePlugin gRPC service and its registration life cycle."""
