"""``python -m kvload``: the command line (same as the ``kvload`` script)."""

from kvload.cli import main

raise SystemExit(main())
