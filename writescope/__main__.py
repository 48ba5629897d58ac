"""``python -m writescope`` = the ``writescope`` command."""

import sys

from writescope.cli.main import main

sys.exit(main())
