"""The kubelet simulator as a command: `python -m deviceplugin.sim` (see `kubelet_sim`)."""
