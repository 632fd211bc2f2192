"""vgpu: a node-level GPU sharing daemon for Kubernetes."""

__version__ = "0.1.0"
