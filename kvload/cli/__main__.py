"""``python -m kvload.cli``: the command line, as ``kvload`` runs it (and ends it: :func:`kvload.process_end.leave`)."""

import sys

from kvload.cli.entry import main
from kvload.process_end import leave

if __name__ == "__main__":
    from pipeline.signals import ends_process

    ends_process()
    sys.exit(leave(main()))
