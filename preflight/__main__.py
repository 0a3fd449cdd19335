"""``python -m preflight`` and the ``preflight`` command: `preflight._cli.main`, with Ctrl-C at any point (during
the imports of torch and transformers too) a one-line "interrupted" and exit status 130, not a traceback."""

import sys

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a process stopped by Ctrl-C


def _interrupted(signum: int, frame: object) -> None:
    """SIGINT: remember it, then raise KeyboardInterrupt as Python's default handler does. A library that swallows
    the KeyboardInterrupt during an import (a bare ``except:``) would otherwise turn Ctrl-C into another error."""
    _interrupted.pressed = True
    raise KeyboardInterrupt


_interrupted.pressed = False
_interrupted.raises_keyboard_interrupt = True  # `preflight.trace._interrupts` treats it as Python's default


def run() -> int:
    """Exit status 130 after Ctrl-C. CPython itself may then end the process by SIGINT instead (an interrupt that
    landed inside ``exec`` of a string, as `dataclasses` does while torch imports, marks it unhandled): a shell
    shows 130 either way, `subprocess` a return code of -2."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted)
    try:
        code = _run()
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except BaseException:
        if not _interrupted.pressed:
            raise
        code = EXIT_INTERRUPTED  # a library caught the KeyboardInterrupt and raised another error from it
    if code == EXIT_INTERRUPTED or _interrupted.pressed:
        sys.stderr.write("\npreflight: interrupted\n")
        return EXIT_INTERRUPTED
    return code


def _run() -> int:
    import preflight

    if getattr(preflight, "__file__", None) is None:  # a namespace package: a folder named preflight shadows ours
        folders = ", ".join(getattr(preflight, "__path__", []))
        sys.stderr.write(f"preflight: error: `preflight` was imported from the folder {folders}, which is not "
                         "the package (a clone of preflight named `preflight`, run from the folder holding it?). "
                         "Run from another folder, or rename the clone (e.g. to preflight-memory).\n")
        return 2
    from preflight._cli import main

    return main()


if __name__ == "__main__":
    sys.exit(run())
