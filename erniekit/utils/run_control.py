"""What keeps a training run in hand from outside: a stop request by signal (the WebUI's stop
button sends SIGTERM, a terminal Ctrl-C sends SIGINT) that ends the run after the current step
with a checkpoint, and a lock so that two runs never write into one output_dir at once."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

from erniekit.errors import ConfigError

LOCK_NAME = ".erniekit-run.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def output_dir_lock(output_dir: str):
    """Hold output_dir for this process; a live holder is a one-line error, a dead one's lock is taken over."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, LOCK_NAME)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(open(path).read().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and pid != os.getpid() and _alive(pid):
                raise ConfigError(
                    f"output_dir={output_dir} is in use by a running training job (pid {pid}); choose "
                    "another output_dir or stop that job first"
                ) from None
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)  # its holder is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        break
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if open(path).read().strip() == str(os.getpid()):
                os.remove(path)


# set by a parent that forwards its own SIGTERM to the run (the WebUI): a later stop signal is then
# ignored, as in a launched rank, since the run may get the same SIGTERM twice (systemd signals
# every process of the service, the WebUI forwards it too) and a second one would kill it before
# its checkpoint; SIGKILL still ends it
STOP_ONCE_ENV = "ERNIEKIT_STOP_ONCE"
STOPPED_EXIT_BASE = 128  # a run stopped by signal N exits 128 + N (143 SIGTERM, 130 SIGINT), as shells report it

_requested = {"signal": 0}  # the first stop signal this process got (0: none); the trainer polls it


def stop_signal() -> int:
    """The signal number of this process's pending stop request, 0 when none."""
    return _requested["signal"]


def request_stop(signum: int = signal.SIGTERM) -> None:
    """Ask the run to end after its current step (with a checkpoint); the first request's signal is kept."""
    if not _requested["signal"]:
        _requested["signal"] = int(signum)


def stopped_exit_code(signum: int) -> int:
    """What `erniekit train` exits with after a stop by `signum`: the shell's 128 + N, which schedulers
    read as "terminated by signal N", never 0 (finished), 1 (failed) or 2 (user error)."""
    return STOPPED_EXIT_BASE + int(signum)


def stops_once(launched_world: int, environ=os.environ) -> bool:
    """Whether later stop signals are ignored once one arrived: a launched rank, or a run whose
    parent set STOP_ONCE_ENV."""
    return launched_world > 1 or environ.get(STOP_ONCE_ENV) == "1"


@contextlib.contextmanager
def stop_on_signal(launched: bool = False):
    """SIGTERM / SIGINT request a stop once: the run ends after its step, with a checkpoint.

    Single process: a second signal acts as it did before (a second Ctrl-C interrupts at once).
    A rank of a launched job ignores later signals: its launcher repeats SIGTERM (paddle's sends
    it up to 3 times 0.2 s apart) and the ranks must still finish the agreed step together; the
    `erniekit train` parent escalates to SIGKILL after its grace period. Installed after paddle's
    import, it replaces paddle's own SIGTERM handler (a `FatalError: Termination signal` exit).
    Only in the main thread (Python runs signal handlers there)."""
    _requested["signal"] = 0
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum, frame):
        if _requested["signal"] and launched:
            return  # already stopping: the agreed step ends it
        request_stop(signum)
        if not launched:
            for s, h in previous.items():  # the next signal is not ours to soften
                signal.signal(s, h if h is not None else signal.SIG_DFL)

    for s in previous:
        signal.signal(s, handler)
        # restart system calls the signal interrupts (SA_RESTART): Python installs its handlers
        # without it, and the signal may land in any thread, e.g. one of gloo's or paddle's C++
        # threads in a socket read; the handler only sets a flag, nothing needs the interruption
        signal.siginterrupt(s, False)
    try:
        yield
    finally:
        stopping = launched and _requested["signal"]
        for s, h in previous.items():
            # a stopping rank (or WebUI run) is about to exit 128 + N: a repeat of the signal that
            # lands after its checkpoint must not turn that into death by signal
            signal.signal(s, signal.SIG_IGN if stopping else h if h is not None else signal.SIG_DFL)
        _requested["signal"] = 0


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Linux: have the kernel send this process `sig` when its parent dies (prctl PR_SET_PDEATHSIG),
    so a SIGKILLed launcher leaves no rank training on; False where prctl is not available."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(1, int(sig), 0, 0, 0) == 0  # 1 = PR_SET_PDEATHSIG
