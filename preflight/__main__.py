import sys

from preflight._cli import main

sys.exit(main())
