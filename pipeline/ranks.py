"""This process's place among the ranks of a run, and the collectives kvload needs (``torch.distributed``).

torchrun (or any launcher of torch's) sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; a process without
them is rank 0 of 1 and never touches ``torch.distributed``. With several ranks the default process group
is initialised on first use (NCCL on CUDA, gloo on CPU) with a timeout, so a rank that never arrives
fails the collective instead of hanging it; kvload's own small messages (digests, budgets) always travel
over a gloo group. Importing this module imports no torch.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from pipeline.errors import RankError, RankLostError
from pipeline.limits import short_text

if TYPE_CHECKING:
    from pipeline.audit import JsonlSink

#: Seconds a collective waits for the other ranks before failing (weights load between two of them).
TIMEOUT_ENV = "KVLOAD_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
#: Set to "kvload" in the rank processes kvload's CLI launched itself (``kvload.cli.launch``), absent under torchrun.
LAUNCHER_ENV = "KVLOAD_LAUNCHER"
#: The longest collective timeout taken (a week): a rank gone longer is lost, and torch's timeout must be finite.
MAX_TIMEOUT_S = 7 * 86400.0

_groups: dict[str, Any] = {}
_T = TypeVar("_T")
#: How often the main thread wakes while a collective runs (signal handlers run only then)
_POLL_S = 0.1
#: How long an aborted rendezvous is given to end once its store is gone (it ends within a second).
ABORT_S = 30.0
#: How long a call whose watch raised, and that cannot be aborted, is given to end by itself.
_ENDS_S = 1.0


def interruptible(call: Callable[[], _T], watch: Callable[[], None] | None = None,
                  abort: Callable[[], None] | None = None) -> _T:
    """``call()`` (a rendezvous, a collective) run so that SIGTERM and SIGINT still act while it blocks.

    CPython runs signal handlers in the main thread between bytecodes only, so a main thread blocked inside gloo's
    TCPStore wait (a peer that failed before the rendezvous) ignored ``kill`` until the collective timed out
    (``KVLOAD_DIST_TIMEOUT_S``, 600 s; torchrun escalated to SIGKILL after 30 s, leaving temporary files). The call
    runs on kvload's collectives thread instead while the main thread waits in short slices: ``Terminated`` or
    ``KeyboardInterrupt`` is raised there, the usual cleanup runs, and the blocked thread ends with the process.
    One long-lived thread, not one per call: generation makes a collective every step (~30 µs a handoff against
    ~90 µs to start a thread).

    ``watch()`` runs at each slice of the wait (on any thread, then the call runs on the collectives thread too): what
    it raises ends the wait, after ``abort()`` (which makes the call end: its rendezvous gone) and the call's end,
    awaited up to :data:`ABORT_S`, so the collectives thread is free for the next call. Without ``abort`` the call
    is given :data:`_ENDS_S` to end by itself (then its own outcome stands); one that does not is left to the
    collectives thread, and the next call gets a new one.
    """
    if threading.current_thread() is not threading.main_thread() and watch is None:
        return call()
    box: dict[str, Any] = {}
    done = threading.Event()

    def job() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the main thread
            box["error"] = exc
        finally:
            done.set()

    _worker().put(job)
    while not done.wait(_POLL_S):
        if watch is not None:
            try:
                watch()
            except BaseException as exc:
                # a rank that exited once its bytes were through (a stop's) may be seen gone before this wait saw
                # the call end (a loaded machine): the call's own outcome stands
                if abort is None and isinstance(exc, Exception) and done.wait(_ENDS_S):
                    break
                if abort is not None:
                    abort()
                # without an abort the call cannot be ended (gloo's send to a rank that died, :func:`_lost_peer`)
                if not done.wait(ABORT_S if abort is not None else 0):
                    _retire_worker()  # still inside the call: the next call gets a thread of its own
                raise
    if "error" in box:
        error = box["error"]
        lost = lost_rank_message(error)
        if lost is not None:
            raise RankLostError(lost) from error
        raise error
    return box["value"]


#: What gloo's TCP transport (and NCCL) say when the process at the other end of a pair is gone.
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed",
              "nccl communicator was aborted", "remote process exited")
#: gloo's ``[/path/to/pair.cc:553] `` prefix and the advice it appends after the reason.
_GLOO_WHERE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")
_GLOO_ADVICE = re.compile(r"\.?\s*This is typically caused by.*$", re.S)


def lost_rank_message(exc: BaseException) -> str | None:
    """The one line for a ``torch.distributed`` error saying another rank's process went away, else None."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, RankError):
        return None
    text = str(exc).strip()
    if not any(words in text.lower() for words in _PEER_GONE):
        return None
    first = text.splitlines()[0] if text else ""
    reason = _GLOO_ADVICE.sub("", _GLOO_WHERE.sub("", first)).strip().rstrip(".") or type(exc).__name__
    return f"lost contact with another rank (it exited or was killed): {reason}"


_jobs: queue.SimpleQueue[Callable[[], None]] | None = None
#: Called once just before this process joins the process group's rendezvous (see :func:`before_rendezvous`).
_before_rendezvous: Callable[[], None] | None = None
#: Called at each slice of rank 0's wait in the rendezvous (see :func:`before_rendezvous`).
_rendezvous_watch: Callable[[], None] | None = None


@contextlib.contextmanager
def before_rendezvous(call: Callable[[], None], watch: Callable[[], None] | None = None) -> Iterator[None]:
    """While the block runs, ``call()`` runs just before this process joins the process group's rendezvous, and what
    it raises ends the load there. ``kvload.LLM``'s rank 0 waits in it until every rank it started is about to join
    (each says so), noticing one that died first: once in torch's rendezvous it could only wait for the rank until
    the collective timeout (``KVLOAD_DIST_TIMEOUT_S``), and a rendezvous given up on leaves torch unable to start
    another group in the process.

    ``watch`` (rank 0 only): run every tenth of a second while this process waits in the rendezvous itself; what
    it raises (a rank that died in the handshake) ends the rendezvous at once (:func:`_hosted_init`), not at the
    timeout."""
    global _before_rendezvous, _rendezvous_watch
    before, _before_rendezvous = _before_rendezvous, call
    watched, _rendezvous_watch = _rendezvous_watch, watch
    try:
        yield
    finally:
        _before_rendezvous, _rendezvous_watch = before, watched


def _worker() -> queue.SimpleQueue[Callable[[], None]]:
    """The queue of the daemon thread that runs :func:`interruptible`'s calls, started on first use."""
    global _jobs
    if _jobs is None:
        jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

        def serve() -> None:
            while True:
                jobs.get()()

        threading.Thread(target=serve, name="kvload-collectives", daemon=True).start()
        _jobs = jobs
    return _jobs


def _forget_worker() -> None:
    global _jobs
    _jobs = None  # a forked child has the queue but not the thread: it starts its own


os.register_at_fork(after_in_child=_forget_worker)


def _retire_worker() -> None:
    """Leave the collectives thread to a call that cannot end before the collective timeout (it serves its own queue,
    which nothing else reaches): the next :func:`interruptible` call starts a new thread. The stuck call's frame keeps
    its process group referenced, which is what lets the process exit at once: ``destroy_process_group`` dropping the
    last reference waited for gloo's stuck send, to the timeout (measured, with the call's references let go)."""
    global _jobs
    _jobs = None


#: The other ranks' processes on this machine, by rank: (pid, start time in clock ticks since boot, its
#: :data:`_output`), set when the object group forms (:func:`_gather_processes`). A rank on another machine (or in
#: another pid namespace) is absent.
_peers: dict[int, tuple[int, int, tuple[str, tuple[str, ...]] | None]] = {}
#: The file this process writes through a temporary beside it (its ``--audit-log``, absolute) and the temporaries
#: that were beside it before this process wrote (:func:`note_output`); told to the other ranks with its identity.
_output: tuple[str, tuple[str, ...]] | None = None
#: Whether this process's object group formed and the ranks told each other who they are (:func:`_gather_processes`):
#: from then on the ranks on this machine know this one's output, to remove its temporary should it be SIGKILLed.
_met = False


def note_output(path: str | os.PathLike[str]) -> None:
    """Take note of ``path`` before this rank writes it through a temporary (its ``--audit-log``). The ranks on this
    machine learn it with this process's identity when the group forms: should this process die with no cleanup
    (SIGKILL; under torchrun nothing else runs for it), one that outlives it removes the temporaries that appeared
    beside ``path`` since (:func:`remove_lost_peers_temporaries`). Call it before the first collective."""
    from pipeline.audit import temporaries

    global _output
    full = os.path.abspath(path)  # the ranks on this machine may run elsewhere than this process's directory
    _output = (full, tuple(sorted(temporaries(full))))


def peers_met() -> bool:
    """Whether the ranks have met (the object group formed, each told the others its identity and :func:`note_output`):
    a rank creates its audit temporary only then (``JsonlSink(..., wait=...)``), since a rank SIGKILLed before it is
    known to no other, and a temporary it had made would stay."""
    return _met


def remove_lost_peers_temporaries() -> None:
    """Remove what the ranks on this machine that have exited left beside their output (:func:`note_output`): the
    temporaries that appeared there since each took note. A rank whose command failed calls it once its own file is
    discarded: a rank SIGKILLed under torchrun left its unpublished audit log (kvload's launcher removes it for the
    ranks it started; torchrun cannot). A rank alive, on another machine, or met in no group formed is left alone; one
    that exited on its own already removed (or published) its temporary, so nothing of it is there to remove."""
    from pipeline.audit import remove_new_temporaries

    for pid, start, output in list(_peers.values()):
        if output is not None and _gone(pid, start):
            remove_new_temporaries(*output)


def _process_identity() -> tuple[str, str, int, int] | None:
    """This process as another on the same machine can look it up in ``/proc``: (boot id, pid namespace, pid, start
    time); None without ``/proc`` (not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
        pid = os.getpid()
        return boot, namespace, pid, _start_ticks(pid)
    except (OSError, ValueError, IndexError):
        return None


def _stat_fields(pid: int) -> list[str]:
    """``/proc/PID/stat``'s fields after the command's name (which may hold spaces and ")"): the state first."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _start_ticks(pid: int) -> int:
    """When process ``pid`` started (``/proc/PID/stat``'s 22nd field): a pid reused by a new process differs."""
    return int(_stat_fields(pid)[19])


def _gone(pid: int, start: int) -> bool:
    """Whether the process ``pid`` started at ``start`` has exited (a zombie not yet reaped counts as exited)."""
    try:
        fields = _stat_fields(pid)
    except FileNotFoundError:
        return True
    except OSError:
        return False  # unreadable: not known to be gone
    return fields[0] in ("Z", "X", "x") or int(fields[19]) != start


def _gather_processes(rank: int, group: Any) -> None:
    """Every rank's process identity, once the object group formed: :func:`_lost_peer` watches those on this machine."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size(group)
    mine = _process_identity()
    told = None if mine is None else (*mine, _output)
    interruptible(lambda: dist.all_gather_object(everyone, told, group=group))
    _peers.clear()
    for other, who in enumerate(everyone):
        if other != rank and mine is not None and who is not None and tuple(who[:2]) == mine[:2]:
            _peers[other] = (int(who[2]), int(who[3]), who[4])
    global _met
    _met = True


def _lost_peer() -> None:
    """Raise :class:`RankLostError` when another rank's process on this machine has exited: the watch of a broadcast's
    sender. gloo never fails a send still queued when its receiver dies (the pair's error wakes the receives pending
    on it, not an unbound buffer's send), so a sender whose bytes were in flight then waited the whole collective
    timeout (``KVLOAD_DIST_TIMEOUT_S``, 600 s): ``kvload serve``'s clients silent that long after a follower's
    SIGKILL. Nothing travels for it: the watch reads ``/proc`` only while a broadcast waits (each 0.1 s)."""
    for rank, (pid, start, _) in _peers.items():
        if _gone(pid, start):
            raise RankLostError(f"lost contact with another rank (it exited or was killed): rank {rank} (pid {pid}) "
                                "exited")


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    text = environ.get(name)
    if text is None or text == "":
        return default
    # the digits 0-9 only, as the flags read them: int() also reads other scripts' digits (and "1_0"), and a value
    # of thousands of digits is quoted cut short, so the error stays one readable line
    if re.fullmatch(r"-?[0-9]{1,18}", text.strip()) is None:
        raise RankError(f"environment {name}={short_text(text)}: expected an integer (torchrun sets it)")
    return int(text)


def timeout_s(environ: Mapping[str, str] = os.environ) -> float:
    """The collective timeout: ``$KVLOAD_DIST_TIMEOUT_S`` or :data:`DEFAULT_TIMEOUT_S`."""
    text = environ.get(TIMEOUT_ENV)
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_TIMEOUT_S:  # NaN too: it, and inf, reached torch's timedelta as a traceback's words
        raise RankError(f"environment {TIMEOUT_ENV}={short_text(text)}: expected a number of seconds in (0, "
                        f"{MAX_TIMEOUT_S:g}] (a week)")
    return value


@attrs.frozen
class Ranks:
    """Who this process is (``rank`` of ``world_size``; ``local_rank`` on its node) and how it talks to the others."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        """Whether other ranks take part (``world_size > 1``)."""
        return self.world_size > 1

    @property
    def is_first(self) -> bool:
        """Rank 0: the one that prints and writes shared files."""
        return self.rank == 0

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` alone."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        group = object_group()
        interruptible(lambda: dist.all_gather_object(out, obj, group=group))
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        group = object_group()
        # the sender watches the receivers' processes (:func:`_lost_peer`); a receiver's own wait fails at the death
        interruptible(lambda: dist.broadcast_object_list(box, src=src, group=group),
                      watch=_lost_peer if self.rank == src else None)
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank arrives (bounded by the timeout)."""
        if self.distributed:
            import torch.distributed as dist

            group = object_group()
            interruptible(lambda: dist.monitored_barrier(group=group, timeout=_timedelta()))

    def to_dict(self) -> dict[str, int]:
        """Plain form for events."""
        return attrs.asdict(self)


def ranks_from_env(environ: Mapping[str, str] = os.environ) -> Ranks:
    """This process's :class:`Ranks` from torchrun's variables (rank 0 of 1 without them)."""
    world = _env_int(environ, "WORLD_SIZE", 1)
    rank = _env_int(environ, "RANK", 0)
    local = _env_int(environ, "LOCAL_RANK", rank)
    if world < 1 or not 0 <= rank < world:
        raise RankError(f"environment RANK={rank} WORLD_SIZE={world}: expected 0 <= RANK < WORLD_SIZE")
    if world > 1:
        timeout_s(environ)  # a bad timeout named now, not at the first collective after the parse
    return Ranks(rank, world, local)


def rank_audit_path(path: str | os.PathLike[str], ranks: Ranks) -> str:
    """Where this rank writes the audit log asked for at ``path``: rank 0 at ``path``, rank N ``<stem>.rankN<suffix>``.

    Every rank gets the same ``--audit-log``; rank 0's file is the one whose run printed the summary.
    """
    from pathlib import Path

    text = os.fspath(path)
    if ranks.rank == 0 or text == "":  # as given: Path("") is ".", and the check of "" must say "empty path"
        return text
    p = Path(text)
    return os.fspath(p.with_name(f"{p.stem}.rank{ranks.rank}{p.suffix}"))


def rank_audit_sink(path: str | os.PathLike[str], ranks: Ranks, *, flag: str, replace: bool = True) -> JsonlSink:
    """This rank's sink for the audit log asked for at ``path`` (the CLI's ``--audit-log``, the API's ``audit_log``):
    its file (:func:`rank_audit_path`) refused now, naming ``flag``, when it cannot be written (or, unless ``replace``,
    exists). With several ranks it is noted first (:func:`note_output`: should this rank be SIGKILLed, the ranks on
    this machine remove its temporary) and its records wait in memory until the ranks met (:func:`peers_met`: a rank
    killed before is known to none of them, and a temporary it had made would stay). Close it with
    :func:`close_rank_audit`."""
    from pipeline.audit import JsonlSink, check_output_path

    target = rank_audit_path(path, ranks)  # rank N writes <stem>.rankN<suffix>
    check_output_path(target, flag, replace=replace)
    if ranks.distributed:  # before its temporary exists
        note_output(target)
    return JsonlSink(target, replace=replace, flag=flag, wait=_not_met if ranks.distributed else None)


def close_rank_audit(sink: JsonlSink, ranks: Ranks, *, ok: bool) -> None:
    """Publish (``ok``) or discard the sink :func:`rank_audit_sink` made for ``ranks``; a rank that failed also removes
    what the ranks SIGKILLed beside it (its cause, often) left beside their audit logs
    (:func:`remove_lost_peers_temporaries`)."""
    sink.close(ok=ok)
    # a rank only: a process that is none may know peers all the same (a kvload.LLM's ranks, whose group it hosts),
    # and what they left is no part of this run
    if not ok and ranks.distributed:
        from pipeline.signals import deferred

        with deferred():  # torchrun's SIGTERM to the ranks left must not cut this short
            remove_lost_peers_temporaries()


def _not_met() -> bool:
    """Whether the ranks have not met yet: an audit sink keeps its records in memory until they have."""
    return not peers_met()


def _timedelta() -> Any:
    import datetime

    return datetime.timedelta(seconds=timeout_s())


def object_group() -> Any:
    """The gloo group kvload's own messages travel on; initialises the default group when nobody has."""
    group = _groups.get("objects")
    if group is not None:
        return group
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        cuda = torch.cuda.is_available()

        def init() -> None:
            if cuda:  # the current device is per thread: set where the group starts too
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl" if cuda else "gloo", timeout=_timedelta())

        if _before_rendezvous is not None:
            _before_rendezvous()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        try:  # the rendezvous waits for every rank: interruptible, so kill acts while one never comes
            if _rendezvous_watch is not None:
                _hosted_init("nccl" if cuda else "gloo", _rendezvous_watch)
            else:
                interruptible(init)
        except (RuntimeError, ValueError) as exc:
            if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
                # rank 0 listens there for the rendezvous; "launch the ranks with torchrun" sent a user who did to
                # look for something else
                where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
                raise RankError(f"torch.distributed cannot start: the rendezvous address MASTER_ADDR:MASTER_PORT "
                                f"{where} is already in use by another process; give a free port (torchrun "
                                "--master-port PORT, or MASTER_PORT)") from exc
            raise RankError(f"torch.distributed cannot start ({str(exc).splitlines()[0] if str(exc) else exc!r}); "
                            "launch the ranks with torchrun") from exc
        atexit.register(shutdown)
    # on NCCL the init does not wait for the ranks (no barrier without a device_id): this rendezvous does, so it is
    # watched as the init is, and dropping the hosted store ends it
    group = None if dist.get_backend() == "gloo" else interruptible(
        lambda: dist.new_group(backend="gloo", timeout=_timedelta()), watch=_rendezvous_watch,
        abort=(lambda: _groups.pop("server", None)) if _rendezvous_watch is not None else None)
    group = group if group is not None else dist.group.WORLD
    _gather_processes(dist.get_rank(), group)
    _groups["objects"] = group
    return group


def _hosted_init(backend: str, watch: Callable[[], None]) -> None:
    """Rank 0's ``init_process_group`` with the rendezvous's store hosted here, so that it can be ended: ``watch()``
    runs while the group forms, and what it raises (a rank that died mid-handshake, with its pid and signal) ends the
    wait at once. torch's own ``env://`` rendezvous could only wait for the rank until the collective timeout: its
    store lives inside the call. Here rank 0 holds the store's server (the other ranks reach it at MASTER_ADDR:
    MASTER_PORT as before, as clients) and joins through a client of its own; dropping the server ends every wait on
    it, so the call fails within a second and leaves no port listening. The server is kept while the group lives
    (:func:`shutdown` lets it go): the group's later rendezvous (``new_group``) use it."""
    import torch
    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    world, timeout = int(os.environ["WORLD_SIZE"]), _timedelta()
    server = [dist.TCPStore(addr, port, world, is_master=True, timeout=timeout, wait_for_workers=False,
                            multi_tenant=False)]
    client = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout, wait_for_workers=False)

    def init() -> None:
        if backend == "nccl":  # the current device is per thread: set where the group starts too
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # the prefix torch's env:// rendezvous (the other ranks') puts before the group's keys
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", client), rank=0, world_size=world,
                                timeout=timeout)

    from torch.distributed import distributed_c10d

    count = distributed_c10d._world.group_count
    try:
        interruptible(init, watch=watch, abort=server.clear)  # clear: the server's only reference goes
    except BaseException:
        server.clear()
        if not dist.is_initialized():
            # the call named a group that never formed: the next one would be named apart from its ranks' (their
            # rendezvous keys differ, and it waited for the timeout), so the count goes back
            distributed_c10d._world.group_count = count
        raise
    _groups["server"] = server[0]


def shutdown() -> None:
    """Destroy the process group this module started (run at exit), and the rendezvous store rank 0 hosted."""
    global _met
    server = _groups.pop("server", None)
    _groups.clear()
    _peers.clear()
    _met = False  # a group formed later is met anew (a process that runs commands in turn: tests, a notebook)
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    del server  # after the group: its last store operations reach it


__all__ = ["DEFAULT_TIMEOUT_S", "LAUNCHER_ENV", "TIMEOUT_ENV", "Ranks", "close_rank_audit", "lost_rank_message",
           "note_output", "object_group", "peers_met", "rank_audit_path", "rank_audit_sink", "ranks_from_env",
           "remove_lost_peers_temporaries", "shutdown", "timeout_s"]
