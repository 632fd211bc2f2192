"""The device-plugin frontend: vgpu served to the kubelet as device plugins (kubelet API
v1beta1), one per extended resource.

- `server`: the DevicePlugin gRPC service (ListAndWatch, Allocate, GetPreferredAllocation);
  every decision is the pure modules'.
- `lifecycle`: one resource's socket and its registration with the kubelet, kept through
  kubelet restarts.
- `resources`: one endpoint (service and life cycle) per resource the inventory names.
- `tracker`: the allocations in step with pod-resources and the kubelet's device checkpoint.
"""
