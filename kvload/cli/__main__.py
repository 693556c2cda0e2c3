"""``python -m kvload.cli``: the command line, as ``kvload`` runs it."""

import sys

from kvload.cli.entry import main

if __name__ == "__main__":
    sys.exit(main())
