"""GPU backends: the real one on NVML, and the fake one driven by a JSON state file."""
