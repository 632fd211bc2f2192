"""The exception hierarchy. Every error the daemon raises on purpose is a DevicePluginError."""

from __future__ import annotations


class DevicePluginError(Exception):
    """Base of every error vgpu raises on purpose."""


class ConfigError(DevicePluginError):
    """The config file is invalid. `problems` lists every finding, each naming the key path."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = list(problems)
        self.source = source
        super().__init__(f"{source}: " + "; ".join(self.problems))


class BackendError(DevicePluginError):
    """The GPU backend cannot answer (driver missing, state file unreadable at start, ...)."""


class StartupError(DevicePluginError):
    """Something the daemon needs at start is not there (a port, a directory); the message says
    what and what to change."""


class StateFileError(BackendError):
    """The fake backend's state file is malformed; the message names the field and the fix."""


class AllocationError(DevicePluginError):
    """A request names devices we cannot hand out; the servicer maps it to INVALID_ARGUMENT."""


class RegistrationError(DevicePluginError):
    """The kubelet refused our registration (wrong version, bad resource name)."""


class MemoryLimitError(BackendError):
    """A GPU memory limit could not be set, read or cleared (docs/design.md §15). `code` is the
    NVML return code (None when the call never reached the driver: an unknown GPU, a timeout),
    `code_name` its name; the message names the GPU, the cgroup and what to do."""

    def __init__(self, message: str, code: int | None = None, code_name: str = "") -> None:
        self.code = code
        self.code_name = code_name
        super().__init__(message)
