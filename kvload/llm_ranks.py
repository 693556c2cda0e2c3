"""``kvload.LLM(model, tensor_parallel_size=N)`` outside torchrun: the LLM starts ranks 1..N-1 itself (vLLM's habit).

The caller's process is rank 0. Each other rank is a child (``python -m kvload.llm_ranks``) with torchrun's variables
(:func:`kvload.cli.launch.rank_env`, as the CLI's launcher gives its ranks), a parent-death signal and a socket to
rank 0; it builds the same ``LLM`` (the same arguments, sent pickled) and then makes every engine call rank 0 makes
(:data:`FOLLOWED`, and ``generate_stream``: the method's name and arguments, pickled), dropping the results; a
stream's ranks stop after the step where rank 0's consumer left (``engine.executor``'s ``stream_stop``, sent with the
step's tokens). So every rank runs the same engine steps, which is what torchrun's mode relies on too (each rank runs
the same script): the sharded forwards all-reduce over the process group, the tokens sampled are rank 0's (broadcast
each step), so sampling gives one process's tokens.

After each call every rank reports how its call ended. A rank that died, or failed where rank 0 did not, makes the
call raise one ``RankError`` naming it, and the LLM is unusable from then on (its ranks can no longer be known to step
alike); the same error on every rank (a bad prompt) is rank 0's, raised once. Waits are bounded by the collective
timeout (``KVLOAD_DIST_TIMEOUT_S``). :meth:`SpawnedRanks.close` (``LLM.close``, its ``with`` block, garbage collection,
interpreter exit) ends the ranks and reaps them; a rank whose parent dies gets SIGTERM, and EOF on its socket.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.connection import Connection
from typing import Any

from kvload.cli.launch import GRACE_S, RANK_VARIABLES, die_with_parent, ended_how, master_address, rank_env
from pipeline.errors import GenerationError, RankError
from pipeline.ranks import LAUNCHER_ENV

#: The ``LLM`` methods that run the engine: rank 0 sends each call to the other ranks, which make it too.
FOLLOWED = ("generate", "chat", "embed", "score", "classify", "reward", "encode", "beam_search",
            "reset_prefix_cache")
#: The variable naming the file descriptor of a rank's socket to rank 0.
CHANNEL_ENV = "KVLOAD_LLM_CHANNEL"
#: Seconds the ranks get to close their LLM and exit after rank 0 asks; then SIGTERM, then SIGKILL as long again.
CLOSE_S = 10.0
#: Seconds between SIGTERM and SIGKILL when the ranks are not asked to close (out of step: a call interrupted or
#: failed on rank 0 alone; a failed load; ``close()`` while loading or mid-call): a rank waiting in a collective for
#: the rank 0 that left runs no Python handler until it is killed, so the full ``CLOSE_S`` only made a Ctrl-C take
#: 10 s more; a rank in Python ends by its handler well within this.
PARTED_TERM_S = 2.0
#: How long rank 0, having failed a call, waits for each other rank's outcome: one that failed alike answers at once
#: (the ranks run in step); one still in the call waits in a collective rank 0 left and would answer only at the
#: collective timeout (600 s), so its silence past this is taken as the ranks having parted.
PARTED_S = 30.0
#: How long a rank that got SIGTERM leaves its Python handler to end it before a watcher thread ends the process
#: (:func:`_exit_on_term`): a rank waiting in a collective that rank 0 left runs no handler on its main thread, and
#: was ended only by the SIGKILL ``PARTED_TERM_S`` later; a rank in Python closes its LLM well within this.
TERM_GRACE_S = 0.5
#: How long rank 0 is given to end a call by itself once another rank answered it with an error while rank 0 was still
#: in it: ranks that fail alike end the call within this (they run in step); past it rank 0 waits in a collective the
#: failed rank left (it waits for rank 0's next message), which ended only at the collective timeout.
ALONE_S = 5.0
_POLL_S = 0.05
#: ``LLM`` arguments only rank 0 uses: the other ranks log nothing and have no subscribers, no KV event publisher.
RANK0_ONLY = ("subscribers", "log", "kv_events_config")


def spawn_size(model: Any, config_file: Any, llm_args: Mapping[str, Any]) -> int:
    """How many ranks ``LLM`` should run itself: ``tensor_parallel_size`` (from the arguments or ``config_file``,
    checked against the checkpoint's heads) outside torchrun, else 0. Nothing is logged or written."""
    if any(v in os.environ for v in RANK_VARIABLES):
        return 0  # under torchrun (or the CLI's launcher) this process is one rank of a launched set
    if "tensor_parallel_size" not in llm_args and config_file is None:
        return 0  # models do not set it: only an argument or a config file asks for ranks
    from kvload.api import api_request, execute
    from stages import ApplyModelDefaults, CheckParallel, ParseArgs, ResolveAuto, SnapshotUserFields

    try:
        overrides = copy.deepcopy(dict(llm_args))  # the stages may normalise what they are given
    except Exception:
        overrides = dict(llm_args)
    request = api_request(model, config_file, True, overrides, "kvload.LLM()")  # refused as LLM's own would be
    result = execute(request, [ParseArgs(), SnapshotUserFields(), ApplyModelDefaults(), ResolveAuto(),
                              CheckParallel(starts_ranks=True)], log=False)
    size = int(result.args.tensor_parallel_size)
    return size if size > 1 else 0


def _advice(world: int) -> str:
    return (f"give picklable values (module-level functions, not lambdas, closures or generators), or run the script "
            f"under torchrun --nproc-per-node {world}, where every rank makes its own calls")


def _picklable(call: str, name: str, value: Any, world: int, error: type[Exception]) -> bytes:
    """``value`` pickled; ``error`` naming ``name`` when it cannot be sent to the other ranks."""
    try:
        return pickle.dumps(value)
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise error(f"{call}: {name}: cannot be sent to ranks 1..{world - 1}, which kvload.LLM started for "
                    f"tensor_parallel_size={world} (it does not pickle: {reason}); {_advice(world)}") from None


@contextlib.contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` while the block runs (the load reads torchrun's variables), then as it was."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Rank:
    """One started rank: its process, its socket to rank 0, the file its stderr goes to."""

    def __init__(self, rank: int, proc: subprocess.Popen, conn: Connection, stderr: Any) -> None:
        self.rank, self.proc, self.conn, self.stderr = rank, proc, conn, stderr
        self.early: list[tuple[Any, ...]] = []  # its answer to the call, read while rank 0 was still in it

    def last_words(self) -> str:
        """The last line the rank wrote to stderr ('' if none)."""
        with contextlib.suppress(OSError, ValueError):
            self.stderr.seek(0)
            lines = [ln.strip() for ln in self.stderr.read().decode(errors="replace").splitlines() if ln.strip()]
            return lines[-1][:300] if lines else ""
        return ""

    def gone(self) -> str | None:
        """How the rank's process ended, in words, or None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        words = self.last_words()
        return f"rank {self.rank} (pid {self.proc.pid}) {ended_how(code)}" + (f" ({words})" if words else "")


class SpawnedRanks:
    """Ranks 1..``world``-1 of a ``kvload.LLM`` started in this process (see the module's docstring)."""

    def __init__(self, world: int, model: Any, llm_kwargs: Mapping[str, Any]) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            raise RankError(f"tensor_parallel_size={world}: torch.distributed is already initialized in this process "
                            "but not by torchrun (no WORLD_SIZE); kvload.LLM starts its own ranks and process group, "
                            f"so destroy yours first, or launch the script with torchrun --nproc-per-node {world}")
        sent = {"model": model, **{k: v for k, v in llm_kwargs.items() if k not in RANK0_ONLY}, "log": False}
        # one pickle per argument, so a rank that cannot unpickle one (a class defined in the script run as
        # __main__, which is not a rank's __main__) names it
        self._spec = {name: _picklable("LLM", name, value, world, RankError) for name, value in sent.items()}
        self.world = world
        self.addr, self.port = master_address()
        self.ranks: list[_Rank] = []
        self.broken: str | None = None  # why the ranks can no longer follow rank 0 (every later call raises it)
        self.closed = False
        self.stopping = False  # LLM.close began: a call running now raises rank 0's "closed" error
        self._lock = threading.Lock()
        self._owns_group = False
        self._loading = True  # a failure now ends the LLM's construction (no "close it" advice)
        # the first rank seen to end mid-call (:meth:`_watch_call`): the one to name, not those ended after it
        self._first_gone: _Rank | None = None
        self._call_ended = threading.Event()
        self._watcher: threading.Thread | None = None
        # rank 0's own part of the call ended: from then on only its thread reads the ranks' answers
        self._returned = threading.Event()
        self._reading = threading.Lock()
        self._parted: str | None = None  # a rank that failed the call alone, ended by :meth:`_watch_call`

    # --- starting -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the ranks; each receives the LLM's arguments and builds it, meeting rank 0 at the rendezvous."""
        parent = os.getpid()
        # Linux's parent-death signal fires when the *thread* that started the child ends: an LLM built in a thread
        # that then exits would lose its ranks. Off the main thread they rely on their socket's EOF instead (and a
        # collective's lost peer), which comes when this process ends however it ends.
        on_parent_death = (lambda: die_with_parent(parent)) if threading.current_thread() is threading.main_thread() \
            else None
        try:
            for rank in range(1, self.world):
                mine, theirs = socket.socketpair()
                stderr = tempfile.TemporaryFile()  # noqa: SIM115 (open for the rank's life; _end closes it)
                env = {**rank_env(rank, self.world, self.addr, self.port), CHANNEL_ENV: str(theirs.fileno())}
                try:
                    proc = subprocess.Popen([sys.executable, "-m", "kvload.llm_ranks"], env=env, pass_fds=(
                        theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                        start_new_session=True,  # the terminal's Ctrl-C reaches rank 0, which ends them
                        preexec_fn=on_parent_death)
                finally:
                    theirs.close()
                conn = Connection(mine.detach())
                self.ranks.append(_Rank(rank, proc, conn, stderr))
                conn.send(self._spec)
            for r in self.ranks:  # each took the arguments (or said why not) before rank 0 waits at the rendezvous
                reply = self._reply(r, "LLM")
                if reply[0] != "received":
                    self._fail("LLM", f"rank {r.rank} (pid {r.proc.pid}) cannot unpickle {reply[1]} ({reply[2]}); "
                                      "define its class in a module the ranks can import, not in the script run as "
                                      "__main__")
        except BaseException:
            self.closed = self.stopping = True
            self._end(polite=False)
            raise

    @contextlib.contextmanager
    def rank_zero(self) -> Iterator[None]:
        """The block in which this process loads as rank 0 (torchrun's variables set, then restored); a rank
        that ends before it joins the process group is named then (:meth:`_joining`)."""
        from pipeline.ranks import before_rendezvous

        self._owns_group = True  # the load starts the process group: close destroys it, so another LLM can start one
        env = rank_env(0, self.world, self.addr, self.port)
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                 LAUNCHER_ENV)
        with _environ({k: env[k] for k in names}), before_rendezvous(self._joining, watch=self._watch):
            yield

    def _joining(self) -> None:
        """Wait (bounded) until every other rank says it is about to join the process group; ``RankError`` naming
        the first that died or failed to load first. Rank 0 joins only then: in torch's rendezvous it waited for a
        dead rank until the collective timeout."""
        for r in self.ranks:
            reply = self._reply(r, "LLM")
            if reply[0] != "joining":
                self._fail("LLM", f"rank {r.rank} (pid {r.proc.pid}) failed to load: {reply[2]}")

    def _watch(self) -> None:
        """While rank 0 waits in the process group's rendezvous (every rank said it joins): ``RankError`` naming a rank
        whose process ended meanwhile, its pid and how (a signal, an exit status); the rendezvous is then ended
        (``pipeline.ranks._hosted_init``), not waited out to the collective timeout."""
        for r in self.ranks:
            gone = r.gone()
            if gone is not None:
                self._fail("LLM", gone)

    def loaded(self) -> None:
        """Rank 0 loaded: wait (bounded) until every other rank says it did too."""
        for r in self.ranks:
            reply = self._reply(r, "LLM")
            if reply[0] == "joining":  # a load that formed no process group (rank 0's hook never read it)
                reply = self._reply(r, "LLM")
            if reply[0] != "ready":
                self._fail("LLM", f"rank {r.rank} (pid {r.proc.pid}) failed to load: {reply[2]}")
        self._loading = False

    def load_failed(self, exc: BaseException) -> BaseException:
        """Rank 0's load failed: the error to raise, the ranks ended. Rank 0's own, unless it lost contact with a
        rank: then that rank's (which died first, and why)."""
        from pipeline.errors import RankLostError
        from pipeline.ranks import lost_rank_message

        try:
            if not (isinstance(exc, RankLostError) or lost_rank_message(exc) is not None):
                return exc  # a setting every rank refuses alike: rank 0's words
            deadline = time.monotonic() + GRACE_S
            while time.monotonic() < deadline and not any(r.proc.poll() is not None for r in self.ranks):
                time.sleep(_POLL_S)
            for r in self.ranks:
                if r.proc.poll() is not None and r.proc.returncode != 0:
                    said = self._said(r)  # its own words; else how it ended, which names it already
                    return RankError(f"LLM: tensor_parallel_size={self.world}: " + (
                        f"rank {r.rank} (pid {r.proc.pid}) failed to load: {said}" if said else f"{r.gone()}"))
            return exc
        finally:  # the others may be mid-load, in a collective: no use asking them to close
            self.closed = self.stopping = True
            self._end(polite=False)

    # --- following --------------------------------------------------------------------------------

    def call(self, name: str, method: Callable[..., Any], llm: Any, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        """``method(llm, *args, **kwargs)`` here and on every other rank; rank 0's result."""
        if not self._lock.acquire(blocking=False):
            raise GenerationError(f"{name}: this LLM is already generating (another thread is); finish it first")
        try:
            if self.stopping or getattr(llm, "_closed", False):
                return method(llm, *args, **kwargs)  # its own "this LLM was closed"
            self._usable(name)
            try:
                bound = inspect.signature(method).bind(llm, *args, **kwargs)
            except TypeError:
                return method(llm, *args, **kwargs)  # Python's own error, before anything is sent
            del bound  # checked: the call's arguments fit the method
            self._send(name, method, args, kwargs)
            try:
                self._start_watch()  # in the try: a Ctrl-C as it starts finds the ranks in the call, as any other does
                try:
                    result = method(llm, *args, **kwargs)
                except Exception as exc:
                    self._returning()
                    self._agree(name, exc)
                    raise
                self._returning()
                self._agree(name, None)
                return result
            except Exception:
                raise
            except BaseException:
                # Ctrl-C mid-call: the other ranks may wait in a collective rank 0 left, or answer a call rank 0 no
                # longer waits for; either way they cannot be known to be in step
                self._break(f"tensor_parallel_size={self.world}: a {name} call was interrupted on rank 0, so the "
                            "ranks are no longer in step; this LLM cannot run any more: close it and create a new one")
                raise
            finally:
                self._stop_watch()
        finally:
            self._lock.release()

    def begin(self, name: str, method: Callable[..., Any], llm: Any, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> None:
        """:meth:`call`'s first half, for a stream: the call sent to every rank, which runs it while rank 0's
        consumer reads; :meth:`end` agrees on how it ended. No other call runs in between."""
        if not self._lock.acquire(blocking=False):
            raise GenerationError(f"{name}: this LLM is already generating (another thread is); finish it first")
        try:
            self._usable(name)
            self._send(name, method, args, kwargs)
        except BaseException:
            self._lock.release()
            raise
        self._start_watch()

    def end(self, name: str, mine: BaseException | None) -> None:
        """:meth:`call`'s second half, for a stream begun with :meth:`begin`: every other rank's outcome agreed with
        rank 0's ``mine`` (None: it ended, or its consumer left, where every rank stopped after the same step)."""
        try:
            self._returning()
            if mine is None or isinstance(mine, Exception):
                self._agree(name, mine)
            else:  # Ctrl-C on rank 0's generating thread: the others cannot be known to be in step
                self._break(f"tensor_parallel_size={self.world}: a {name} call was interrupted on rank 0, so the "
                            "ranks are no longer in step; this LLM cannot run any more: close it and create a new one")
        finally:
            self._stop_watch()
            self._lock.release()

    def _returning(self) -> None:
        """Rank 0's part of the call ended: the watcher reads no more answers (this thread reads them now)."""
        with self._reading:
            self._returned.set()

    def _start_watch(self) -> None:
        """Watch the ranks' processes while a call runs (:meth:`_watch_call`), on a thread of its own."""
        self._call_ended.clear()
        self._returned.clear()
        for r in self.ranks:
            r.early.clear()
        self._watcher = threading.Thread(target=self._watch_call, name="kvload-llm-ranks-watch", daemon=True)
        self._watcher.start()

    def _stop_watch(self) -> None:
        self._call_ended.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        for r in self.ranks:
            r.early.clear()  # answers to this call only (all read by now, unless the call broke the LLM)

    def _watch_call(self) -> None:
        """Once a rank's process ends mid-call, end the others (SIGTERM, then SIGKILL ``PARTED_TERM_S`` later).

        With more than two ranks a death did not reach rank 0: gloo's ring all-reduce in the forward waits on a
        living neighbour, itself waiting on the dead rank, and the neighbours stay in their failed collective, so
        rank 0 waited out the collective timeout (``KVLOAD_DIST_TIMEOUT_S``, 600 s) in the forward. Ended, every
        neighbour's connection fails rank 0's wait at once, and the rank that died first is named (the LLM cannot run
        any more either way: the CLI's launcher and torchrun end the others so too).

        A rank that answers the call with an error while rank 0 is still in it (an exception of its own mid-forward)
        stays alive, waiting for rank 0's next message, and left the collective that rank 0 then waited in to the
        timeout: unless rank 0 ends the call within :data:`ALONE_S` (the ranks failed alike), the ranks are ended so
        too, and that rank and its error are named."""
        alone: tuple[float, str, _Rank] | None = None  # when a rank answered with an error, the words, the rank
        while not self._call_ended.wait(_POLL_S):
            if self.stopping or self.broken is not None:
                # the ranks are being ended by close() or _break: nothing left to watch (a stream its consumer holds
                # unread past close() ends its call only when collected, and polled every rank until then)
                return
            gone = next((r for r in self.ranks if r.proc.poll() is not None), None)
            if gone is None and alone is None:
                alone = self._answered_alone()
            if gone is None and (alone is None or time.monotonic() < alone[0] + ALONE_S):
                continue
            if gone is None and alone is not None:
                with self._reading:
                    if self._returned.is_set():
                        continue  # rank 0 ended the call by itself after all: its thread compares the answers
                    self._parted, self._first_gone = alone[1], alone[2]
            else:
                self._first_gone = gone
            for signum in (signal.SIGTERM, signal.SIGKILL):
                for r in self.ranks:
                    if r.proc.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(r.proc.pid, signum)
                deadline = time.monotonic() + PARTED_TERM_S
                while any(r.proc.poll() is None for r in self.ranks) and time.monotonic() < deadline:
                    time.sleep(_POLL_S)
            return

    def _answered_alone(self) -> tuple[float, str, _Rank] | None:
        """Read the answers the ranks sent while rank 0 is still in the call; the first error's time, words, rank."""
        with self._reading:
            if self._returned.is_set():
                return None
            for r in self.ranks:
                with contextlib.suppress(OSError, EOFError):
                    if not r.early and r.conn.poll(0):
                        r.early.append(r.conn.recv())
                        if r.early[0][0] == "error":
                            return (time.monotonic(), f"rank {r.rank} (pid {r.proc.pid}) failed the call while rank "
                                    f"0 was still in it: {r.early[0][1]}: {str(r.early[0][2])[:300]}", r)
        return None

    def _send(self, name: str, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Send the call, one pickle per argument, so a rank that cannot unpickle one names it; then "go", or
        "skip" and ``GenerationError`` naming the argument when a rank could not (nobody runs the call)."""
        params = [p for p in list(inspect.signature(method).parameters.values())[1:]
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        positional = [(params[i].name if i < len(params) else f"argument {i + 1}", v) for i, v in enumerate(args)]
        message = ("call", name, [(label, _picklable(name, label, v, self.world, GenerationError))
                                  for label, v in positional],
                   [(key, _picklable(name, key, v, self.world, GenerationError)) for key, v in kwargs.items()])
        for r in self.ranks:
            try:
                r.conn.send(message)
            except OSError:
                self._lost(name, r)
        refused = [(r, reply) for r in self.ranks if (reply := self._reply(r, name))[0] != "received"]
        for r in self.ranks:
            try:
                r.conn.send(("skip",) if refused else ("go",))
            except OSError:
                self._lost(name, r)
        if refused:
            r, reply = refused[0]
            raise GenerationError(f"{name}: {reply[1]}: rank {r.rank} (pid {r.proc.pid}) cannot unpickle it "
                                  f"({reply[2]}); define its class in a module the ranks can import, not in the "
                                  "script run as __main__")

    def _usable(self, name: str) -> None:
        if self.broken is not None:
            raise RankError(f"{name}: {self.broken}")
        for r in self.ranks:
            if r.gone() is not None:
                self._lost(name, r)

    def _lost(self, name: str, r: _Rank, cause: BaseException | None = None) -> None:
        if self._parted is not None:  # a rank failed the call alone and the ranks were ended (:meth:`_watch_call`)
            self._fail(name, self._parted, cause)
        r = self._first_gone or r  # not a rank ended because another had (:meth:`_watch_call`)
        gone = r.gone() or f"rank {r.rank} (pid {r.proc.pid}) stopped answering"
        self._fail(name, gone, cause)

    def _fail(self, name: str, why: str, cause: BaseException | None = None) -> None:
        if self._loading:
            self._break(f"tensor_parallel_size={self.world}: {why}")
        else:
            self._break(f"tensor_parallel_size={self.world}: {why}; this LLM cannot run any more (its ranks are no "
                        "longer in step): close it and create a new one")
        raise RankError(f"{name}: {self.broken}") from cause

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
        self._end(polite=False)  # the others may be blocked in a collective: no use asking them to close

    def _agree(self, name: str, mine: Exception | None) -> None:
        """Every other rank's outcome of the call; ``RankError`` naming a rank that died or ended it otherwise."""
        if self.stopping:
            return  # closed during the call: rank 0's error ("the LLM was closed") says it
        if self._parted is not None:  # a rank failed alone and the ranks were ended: rank 0's error was its effect
            self._fail(name, self._parted, mine)
        # the ranks agree when they failed alike: by the error's type, not its text, which may hold what differs
        # between processes (an object's address in a repr, a set's order under per-process string hashing)
        kind = type(mine).__name__ if mine is not None else None
        for r in self.ranks:
            reply = self._reply(r, name, mine, PARTED_S if mine is not None else None)
            if reply is None:  # rank 0 failed alone mid-call (a subscriber of its own raised): its error is the news
                self._break(f"tensor_parallel_size={self.world}: a {name} call failed on rank 0 alone, so the ranks "
                            "are no longer in step; this LLM cannot run any more: close it and create a new one")
                mine.add_note(f"kvload: rank {r.rank} (pid {r.proc.pid}) was still in the call {PARTED_S:g} s later; "
                              "the ranks were stopped and this LLM cannot run any more")
                raise mine
            theirs = (reply[1], reply[2]) if reply[0] == "error" else None
            if (theirs[0] if theirs is not None else None) != kind:
                if theirs is None:
                    why = f"rank {r.rank} (pid {r.proc.pid}) completed the call where rank 0 failed ({str(mine)[:200]})"
                else:
                    why = (f"rank {r.rank} (pid {r.proc.pid}) failed where rank 0 did not: {theirs[0]}: "
                           f"{theirs[1][:300]}")
                self._fail(name, why, mine)

    def _reply(self, r: _Rank, name: str, mine: BaseException | None = None,
               within_s: float | None = None) -> tuple[Any, ...] | None:
        """Rank ``r``'s next message, waited for at most the collective timeout (None when ``within_s`` passed first);
        its death raises ``RankError``."""
        from pipeline.ranks import timeout_s

        if r.early:  # read by the watcher while rank 0 was still in the call
            return r.early.pop()
        deadline = time.monotonic() + timeout_s()
        parted = None if within_s is None else time.monotonic() + within_s
        while True:
            try:
                if r.conn.poll(_POLL_S):
                    return r.conn.recv()
            except (OSError, EOFError):
                pass
            if r.proc.poll() is not None or self._first_gone is not None:
                self._lost(name, r, mine)
            if parted is not None and time.monotonic() > parted:
                return None
            if time.monotonic() > deadline:
                self._fail(name, f"rank {r.rank} (pid {r.proc.pid}) did not answer within {timeout_s():g} s "
                                 "(KVLOAD_DIST_TIMEOUT_S)", mine)
            if self.stopping:
                raise RankError(f"{name}: the LLM was closed")

    @staticmethod
    def _said(r: _Rank) -> str | None:
        """The error a rank sent before it exited, if any."""
        with contextlib.suppress(OSError, EOFError):
            while r.conn.poll(0):
                reply = r.conn.recv()
                if reply[0] == "error":
                    return f"{reply[1]}: {reply[2]}"
        return None

    # --- ending -------------------------------------------------------------------------------

    def close(self) -> None:
        """Ask every rank to close its LLM and exit; SIGTERM, then SIGKILL, the ones that do not; reap them all.
        Safe to call twice and at interpreter exit."""
        if self.closed:
            return
        self.closed = self.stopping = True
        # a rank still loading, or in a call (closed from another thread, or mid-stream), waits in a collective
        # and never reads "close": asking it first only added CLOSE_S before the signals
        idle = not self._loading and self._lock.acquire(blocking=False)
        try:
            self._end(polite=idle)
        finally:
            if idle:
                self._lock.release()

    def _end(self, polite: bool = True) -> None:
        for r in self.ranks:
            with contextlib.suppress(OSError, ValueError):
                r.conn.send(("close",))
        for signum in (None, signal.SIGTERM, signal.SIGKILL) if polite else (signal.SIGTERM, signal.SIGKILL):
            if signum is not None:
                for r in self.ranks:
                    if r.proc.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(r.proc.pid, signum)
            deadline = time.monotonic() + (CLOSE_S if polite or signum is None else PARTED_TERM_S)
            while any(r.proc.poll() is None for r in self.ranks) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
            if all(r.proc.poll() is not None for r in self.ranks):
                break
        for r in self.ranks:
            r.proc.wait()
            with contextlib.suppress(OSError):
                r.conn.close()
            with contextlib.suppress(OSError):
                r.stderr.close()
        if self._owns_group:
            from pipeline.ranks import shutdown

            self._owns_group = False
            with contextlib.suppress(Exception):
                shutdown()


# --- what runs in ranks 1..N-1 ----------------------------------------------------------------------


class _Unpickled(Exception):
    """An argument of a call that does not unpickle here: (its name, why)."""


def _loads(label: str, data: bytes) -> Any:
    try:
        return pickle.loads(data)
    except Exception as exc:
        raise _Unpickled(label, str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


def _exit_on_term(grace: float) -> None:
    """Exit on SIGTERM with its status: by a Python handler (the LLM closes, cleanup runs: audit temporaries), or,
    ``grace`` seconds later where that handler has not run yet, at once from a watcher thread. A handler that ran is
    never cut short: its cleanup takes what it takes (rank 0's SIGKILL, ``PARTED_TERM_S`` later, bounds it).

    The signal module's C handler writes each signal's number to the wakeup fd whatever the main thread is doing;
    a daemon thread reads it. The main thread may be in a C call that never returns (a gloo collective whose peer
    left), where the Python handler waits for it; the collective's wait releases the GIL, so this thread runs."""
    handled = threading.Event()

    def handler(*_: Any) -> None:
        handled.set()
        sys.exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def watch(keep: socket.socket) -> None:  # the writer's socket lives as long as this thread: closed, no wakeup
        while True:
            data = reader.recv(64)
            if not data:
                return
            if signal.SIGTERM in data and not handled.wait(grace):  # the main thread is not back in Python
                os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, args=(writer,), name="kvload-rank-term", daemon=True).start()


def main() -> int:
    """One rank: build the LLM rank 0 sent, then make each call rank 0 sends until it says close (or goes away)."""
    conn = Connection(int(os.environ.pop(CHANNEL_ENV)))
    _exit_on_term(TERM_GRACE_S)
    given: dict[str, Any] = {}
    for name, data in conn.recv().items():
        try:
            given[name] = pickle.loads(data)
        except Exception as exc:  # pickled there, does not unpickle here (a class of rank 0's __main__)
            conn.send(("error", name, str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
            return 1
    conn.send(("received",))
    try:
        from kvload.llm import LLM
        from pipeline.ranks import before_rendezvous

        with before_rendezvous(lambda: conn.send(("joining",))):  # rank 0 joins once every rank is about to
            llm = LLM(given.pop("model"), **given)
    except Exception as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", type(exc).__name__, str(exc)))
        return 1
    with llm:
        conn.send(("ready",))
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # rank 0's process went away
                return 1
            if message[0] == "close":
                return 0
            _, name, positional, keywords = message
            try:
                args = [_loads(label, data) for label, data in positional]
                kwargs = {key: _loads(key, data) for key, data in keywords}
            except _Unpickled as exc:
                conn.send(("refused", *exc.args))
            else:
                conn.send(("received",))
            try:
                go = conn.recv()[0] == "go"  # else a rank could not unpickle the call: nobody runs it
            except (EOFError, OSError):
                return 1
            if not go:
                continue
            try:  # the result is rank 0's to return; a stream is read to where rank 0's consumer left it
                getattr(llm, "_followed_stream" if name == "generate_stream" else name)(*args, **kwargs)
            except Exception as exc:
                reply: tuple[Any, ...] = ("error", type(exc).__name__, str(exc))
            else:
                reply = ("ok",)
            try:
                conn.send(reply)
            except OSError:
                return 1


if __name__ == "__main__":
    from kvload.process_end import leave

    # the LLM is closed and its audit published: the rank ends without CPython's module teardown (~2 s of garbage
    # collection over torch's and transformers' objects), so rank 0's close() waits for its work, not for that
    try:
        status = main()
    except SystemExit as exc:  # SIGTERM's handler: the LLM closed on the way out; leave without the teardown too
        status = exc.code if isinstance(exc.code, int) else 1
    sys.exit(leave(status))


__all__ = ["CHANNEL_ENV", "FOLLOWED", "SpawnedRanks", "main", "spawn_size"]
