"""A stand-in for `nvidia-cuda-mps-control`, for tests on machines without a GPU; its entry
point is tests/support/fake_mps_control.py (see there for what it does). Standard library only:
it runs under whatever `python3` is on PATH."""
