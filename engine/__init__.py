"""kvload's serving engine: the driving loop, the generation executor, the workload simulator, capacity reports.

It sits above the stages (it runs them to build what it drives) and below the face (``kvload``).
Modules are imported where used: the executor needs torch, the rest does not.
"""
