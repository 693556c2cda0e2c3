"""The ``kvload`` command line. It only parses, calls the API, and prints.

Results go to stdout, logs to stderr (so ``--json | jq`` works). Errors are one line on stderr:
exit 2 for usage, config, model and route errors, 1 for runtime failures; a traceback only with
``--debug``. torch and transformers are imported only by subcommands that need them.

One module per concern: ``entry`` (``main``: signals, logging, the error line, the exit status), ``commands`` (the
parser with every subcommand), ``plan``, ``generate``, ``simulate``, ``inspection`` (each command's flags and its
``cmd_*``), ``flags`` (the configuration flags), ``values`` (flag value types), ``parser`` (the one-line argparse
parser, secrets hidden), ``files`` (files a command writes or reads), ``output`` (stdout and the error text),
``sampling_defaults`` (read by generate and serve), ``token_printer`` (generate's output) and
``structured_flags`` (generate's structured-output flags).
"""
