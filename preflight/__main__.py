"""``python -m preflight`` and the ``preflight`` command: `preflight._cli.main`, with Ctrl-C at any point (during
the imports of torch and transformers too) a one-line "interrupted" and exit status 130, not a traceback."""

import sys

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a process stopped by Ctrl-C


def run() -> int:
    try:
        import preflight

        if getattr(preflight, "__file__", None) is None:  # a namespace package: a folder named preflight shadows ours
            folders = ", ".join(getattr(preflight, "__path__", []))
            sys.stderr.write(f"preflight: error: `preflight` was imported from the folder {folders}, which is not "
                             "the package (a clone of preflight named `preflight`, run from the folder holding it?). "
                             "Run from another folder, or rename the clone (e.g. to preflight-memory).\n")
            return 2
        from preflight._cli import main

        return main()
    except KeyboardInterrupt:
        sys.stderr.write("\npreflight: interrupted\n")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(run())
