"""`python -m deviceplugin.sim`: the kubelet simulator on its own, for trying the daemon without a
kubelet. The simulator is `deviceplugin.sim.kubelet`, its command line `deviceplugin.sim.cli`."""

import sys

from deviceplugin.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
