"""NRI (the container runtime's Node Resource Interface): the plugin protocol, sans I/O
(`protocol`). Not wired into the daemon yet."""
