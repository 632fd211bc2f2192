"""`python -m deviceplugin.sim`: the kubelet simulator on its own, for trying the daemon without a
kubelet. The simulator itself is `deviceplugin.sim.kubelet`."""

import sys

from deviceplugin.sim.kubelet import main

if __name__ == "__main__":
    sys.exit(main())
