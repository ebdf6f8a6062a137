"""Signals every process of ours stops on, whatever dispositions it inherited.

A background job of a non-interactive shell (`nohup fabric run ... &`, many CI runners and
schedulers) starts with SIGINT ignored, and an ignored disposition survives `exec`. Dagster's
interrupt set-up then gives SIGTERM the disposition of SIGINT, so the process ignores `kill` too,
and so does every child it starts. Each entry point calls `stop_on_signals()` first.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def stop_on_signals(*, sigterm_interrupts: bool = False) -> None:
    """SIGINT raises KeyboardInterrupt; SIGTERM ends the process: by its default action, or, with
    `sigterm_interrupts`, by raising KeyboardInterrupt as SIGINT does (so the caller's clean-up
    runs: workers stopped, leases given back). Handlers the process set itself are kept; only
    ignored (or unknown) dispositions are replaced. Only the main thread can set handlers."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    term = signal.getsignal(signal.SIGTERM)
    if sigterm_interrupts and term in (signal.SIG_IGN, signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    elif term in (signal.SIG_IGN, None):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class StopRequested(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while this process waited on its workers."""


@contextmanager
def stop_requests() -> Iterator[Callable[[], None]]:
    """For a loop that waits on workers: SIGINT and SIGTERM only note the request, and the
    `check` this yields raises StopRequested at the loop's own safe point. (A handler that raises
    does so inside whatever code runs at that moment, a database driver closing a connection for
    one, which may swallow it: the run then goes on.) The handlers before are restored on the way
    out; outside the main thread, where none can be set, `check` never raises."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    received: list[int] = []

    def note(signum: int, _frame: object) -> None:
        received.append(signum)

    def check() -> None:
        if received:
            raise StopRequested(f"stopped by {signal.Signals(received[0]).name}")

    previous = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield check
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
