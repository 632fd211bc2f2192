"""GPU memory limits the driver enforces, per container (docs/design.md §15).

A container's runtime hook (`deviceplugin/hook/vgpu-hook.c`, run by the OCI runtime at
createRuntime: after the container's cgroup exists, before its first instruction) hands the
container's init PID and its grant ID to the daemon; the daemon sets the limits on the
container's own cgroup through the GPU backend, records them, and clears them as the container
goes.

- `record`: the state-directory record of every leaf given a limit.
- `book`: what the parts share (backend, record, lock, mount, action log and counts).
- `apply`: resolving a hook's container, asking the LimitSource, setting and recording.
- `hookserver`: the root-only unix socket the hook speaks to.
- `reconcile`: clearing the limits of containers that go, repairing leaked reservations.
"""
