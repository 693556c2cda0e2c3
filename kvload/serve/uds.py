"""``kvload serve --uds PATH`` (vLLM's flag): listening on a Unix domain socket instead of a TCP host and port.

The socket file is made at bind time and removed when the server stops; a socket a killed server left behind
(nothing listens on it) is replaced, a live server's is refused, and a path that is anything else (a regular file,
a directory, a link) is never touched.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat

from pipeline.errors import ConfigError
from pipeline.limits import short_text

#: The longest path ``bind`` takes for an AF_UNIX socket on Linux (``sun_path`` holds 108 bytes, NUL included).
MAX_PATH_BYTES = 107


def uds_url(path: str, tls: bool = False) -> str:
    """What the ready line names: ``unix:PATH`` as vLLM logs it (``https+unix:PATH`` when serving TLS over it)."""
    return f"{'https+' if tls else ''}unix:{path}"


class UnixListener:
    """A listening Unix socket at ``path``; :meth:`close` closes it and removes the file if it is still this one.

    ``ConfigError`` naming ``flag`` when the socket cannot be had: its directory is missing, the path is taken by
    something that is not a socket, another server listens on it, or ``bind`` fails (too long, no permission)."""

    def __init__(self, path: str, flag: str = "--uds") -> None:
        named = f"{flag} {short_text(path, 200)}"
        if not path or "\0" in path:
            raise ConfigError(f"{named}: expected the path of a socket file to create, such as /run/kvload.sock")
        if len(os.fsencode(path)) > MAX_PATH_BYTES:  # bind's own "AF_UNIX path too long" says no limit
            raise ConfigError(f"{named}: a Unix socket path is at most {MAX_PATH_BYTES} bytes, this one has "
                              f"{len(os.fsencode(path))}; give a shorter one (a relative path counts as written)")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise ConfigError(f"{named}: the directory {short_text(parent, 200)} does not exist; create it first "
                              "(the server makes only the socket file)")
        _clear_stale(path, named)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            sock.listen(2048)  # uvicorn's backlog, as bind() gives the TCP socket
            made = os.stat(path)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"{named}: cannot listen on it ({exc.strerror or exc})") from None
        sock.set_inheritable(True)
        self.path = path
        self.sock = sock
        self._made = (made.st_dev, made.st_ino)  # the file this server made, and so may remove

    def close(self) -> None:
        """Close the socket and remove its file, unless another file has taken the path since (idempotent)."""
        self.sock.close()
        with contextlib.suppress(OSError):
            now = os.lstat(self.path)
            if stat.S_ISSOCK(now.st_mode) and (now.st_dev, now.st_ino) == self._made:
                os.unlink(self.path)


def _clear_stale(path: str, named: str) -> None:
    """Remove a socket file at ``path`` that nothing listens on (a killed server's); ``ConfigError`` for a live one
    or for a path that is not a socket (a user's file is never removed)."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"{named}: cannot look at it ({exc.strerror})") from None
    if not stat.S_ISSOCK(found.st_mode):
        kind = "a directory" if stat.S_ISDIR(found.st_mode) else "a symbolic link" if stat.S_ISLNK(found.st_mode) \
            else "a regular file" if stat.S_ISREG(found.st_mode) else "not a socket"
        raise ConfigError(f"{named}: the path exists and is {kind}, not a socket; give a path that does not exist "
                          "(kvload replaces only a socket file a stopped server left)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:  # no listener: a stopped server's leftover, replaced as uvicorn replaces it
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, None):  # EAGAIN / a timeout: a listener with a full queue, live
            raise ConfigError(f"{named}: cannot tell whether a server listens on it ({exc.strerror or exc})") \
                from None
    finally:
        probe.close()
    raise ConfigError(f"{named}: a server is listening on it already; stop that one or give another path")


__all__ = ["MAX_PATH_BYTES", "UnixListener", "uds_url"]
