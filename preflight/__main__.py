"""``python -m preflight``: the ``preflight`` command (`preflight._cli.main`)."""

import sys

import preflight

if getattr(preflight, "__file__", None) is None:  # a namespace package: some folder named preflight shadows ours
    folders = ", ".join(getattr(preflight, "__path__", []))
    sys.stderr.write(f"preflight: error: `preflight` was imported from the folder {folders}, which is not the "
                     "package (a clone of preflight named `preflight`, run from the folder holding it?). Run from "
                     "another folder, or rename the clone (e.g. to preflight-memory).\n")
    sys.exit(2)

from preflight._cli import main  # noqa: E402

sys.exit(main())
