"""Around the daemon: the kubelet simulator (`kubelet`, run with `python -m deviceplugin.sim`) and
the demo built on it. Nothing in the daemon imports this package."""
