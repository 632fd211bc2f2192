"""`python -m deviceplugin.gpu.fake`: see `cli`."""

import sys

from deviceplugin.gpu.fake.cli import main

sys.exit(main())
