"""kubelet."""
