"""Claiming batches ahead of the submit loop, on a thread of its own.

A worker's submit loop keeps a few batches in flight on the GPU. Claiming the next ones takes a
write transaction; on SQLite that means the database's one write lock, which the result writer
holds for most of each group it commits. A claim made on the submit loop's thread waited for it
(SQLite's busy handler sleeps 1-100 ms between tries), and meanwhile the GPU ran dry: on one
H200, MiniLM-L6's submit loop spent 7 of its 13 s pulling window waiting to claim.

`ClaimAhead` keeps leases claimed and ready, topping up `chunk` at a time on its thread, so a
slow claim delays the ready supply, not the GPU. How many it keeps follows the pace at which the
submit loop takes them: enough for `ahead_s` seconds of batches (at least one chunk, at most
`max_depth`). Fast batches (MiniLM: ~100 a second) need a deep supply to ride out a claim that
waits; slow ones do not, and every lease kept ready is one that another worker sharing the plan
cannot take when the plan's queue runs empty. Leases waiting here are renewed by the worker's
heartbeat like those in flight (the `claim` function given hands them to it). The first empty
claim ends the supply: `take` then returns None, and the worker falls back to its own
end-of-plan claims (failed batches re-queued, other workers' expired leases).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from fabric_pipelines.lib.broker.ledger import Lease

PACE_WINDOW = 32  # leases whose take times give the pace


class ClaimAhead:
    """Leases claimed by `claim(count)` on a background thread, handed out in claim order."""

    def __init__(
        self,
        claim: Callable[[int], list[Lease]],
        chunk: int,
        max_depth: int,
        ahead_s: float = 0.25,
        stopping: threading.Event | None = None,
    ) -> None:
        """`stopping`, where given, is set as `close` begins: a claim waiting to retry (the
        database away) should watch it and give up, so that closing does not wait it out."""
        if not 1 <= chunk <= max_depth:
            raise ValueError(
                f"claim-ahead needs 1 <= chunk <= max_depth, got {chunk} and {max_depth}"
            )
        self._claim = claim
        self._stopping = stopping
        self._chunk, self._max_depth, self._ahead_s = chunk, max_depth, ahead_s
        # Between the last takes, the time the taker spent elsewhere (submitting, the GPU busy),
        # not waiting here for a claim: the pace it could take leases at, not the pace it got.
        self._gaps: deque[float] = deque(maxlen=PACE_WINDOW)
        self._returned_at: float | None = None
        self._ready: deque[Lease] = deque()
        self._changed = threading.Condition()
        self._exhausted = False  # a claim came back empty: no more from this supply
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fabric-claim-ahead", daemon=True)
        self._thread.start()

    def take(self) -> Lease | None:
        """The next lease, waiting for one to be claimed; None once a claim found none. Raises
        what a claim raised."""
        asked_at = time.monotonic()
        with self._changed:
            if self._returned_at is not None:
                self._gaps.append(asked_at - self._returned_at)
            while not self._ready and not self._exhausted and self._error is None:
                self._changed.wait()
            if self._ready:
                lease = self._ready.popleft()
                self._returned_at = time.monotonic()
                self._changed.notify_all()  # room for another chunk, perhaps
                return lease
            if self._error is not None:
                raise self._error
            return None

    def close(self) -> list[Lease]:
        """Stop claiming; returns the leases claimed but never taken (their leases lapse, or
        the caller hands them back)."""
        if self._stopping is not None:
            self._stopping.set()
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()
        with self._changed:
            left = list(self._ready)
            self._ready.clear()
        return left

    def __enter__(self) -> ClaimAhead:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def depth(self) -> int:
        """How many leases to keep ready: `ahead_s` of batches at the pace the taker could take
        them lately (its waits here left out, so a slow supply does not shrink itself); two
        chunks until that pace is known. Called with the condition held."""
        if not self._gaps:
            return min(2 * self._chunk, self._max_depth)
        span = sum(self._gaps)
        per_s = len(self._gaps) / span if span > 0 else math.inf
        wanted = per_s * self._ahead_s
        return self._max_depth if wanted >= self._max_depth else max(self._chunk, math.ceil(wanted))

    def _run(self) -> None:
        while True:
            with self._changed:
                # Top up once a whole chunk fits: a few large claims, not many small ones.
                while not self._closed and len(self._ready) > self.depth() - self._chunk:
                    self._changed.wait()
                if self._closed:
                    return
            try:
                leases = self._claim(self._chunk)
            except BaseException as error:  # handed to the submit loop by `take`
                with self._changed:
                    self._error = error
                    self._changed.notify_all()
                return
            with self._changed:
                self._ready.extend(leases)
                self._exhausted = not leases
                self._changed.notify_all()
                if self._exhausted:
                    return
