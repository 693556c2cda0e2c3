"""``python -m kvload`` and the ``kvload`` console script (pyproject's entry point): the command line.

The command line is imported inside :func:`main`, so a Ctrl-C that lands while it loads (argparse, attrs, the
config classes: most of a ``--help``'s time) is answered as one during the command is, ``error: interrupted``
and exit 130, not with a Python traceback. What runs before this module (interpreter start, ``import kvload``'s
few milliseconds) is out of kvload's reach.
"""

import contextlib
import sys

from kvload.process_end import leave


def main() -> int:
    """Import the command line, then run it; exit 130 with one line if SIGINT came during the import."""
    try:
        from pipeline.signals import ends_process

        ends_process()  # a stop signal repeated while the process exits is ignored (pipeline.signals.release_sigterm)
        from kvload.cli.entry import main as cli_main
    except KeyboardInterrupt:
        with contextlib.suppress(OSError):  # kvload.cli's words for a Ctrl-C; a closed terminal: the status tells
            print("error: interrupted", file=sys.stderr)
        exec("")  # the Ctrl-C was handled: clear CPython's mark of an unhandled one (see kvload.cli.entry.main)
        return 130
    return leave(cli_main())  # ends the process here, past interpreter teardown


if __name__ == "__main__":
    raise SystemExit(main())
