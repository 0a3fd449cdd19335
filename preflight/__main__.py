"""``python -m preflight``: the ``preflight`` command (`preflight._cli.main`)."""

import sys

from preflight._cli import main

sys.exit(main())
