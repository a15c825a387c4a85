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
                raise ConfigError(f"output_dir={output_dir} is in use by a running training job (pid {pid}); choose "
                                  "another output_dir or stop that job first") from None
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


@contextlib.contextmanager
def stop_on_signal(request_stop):
    """SIGTERM / SIGINT call `request_stop()` once (the run ends after its step, with a checkpoint);
    a second signal acts as usual. Only in the main thread of a single-process run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum, frame):
        request_stop()
        for s, h in previous.items():  # the next signal is not ours to soften
            signal.signal(s, h)

    for s in previous:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
