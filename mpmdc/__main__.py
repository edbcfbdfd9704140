"""``python -m mpmdc``: the same as the ``mpmdc`` command."""

import sys

from mpmdc.cli.main import main

sys.exit(main())
