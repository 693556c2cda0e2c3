"""The package version and the audit-log schema version."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("kvload")
except metadata.PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+source"

#: Bumped when the audit-log wire format changes incompatibly.
AUDIT_SCHEMA_VERSION = 1
