"""A value already known, as a finished future: it stands beside futures still computing
(a hash read ahead, one made as the rows arrived) where the caller waits on either alike."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


def done(value: T) -> Future[T]:
    finished: Future[T] = Future()
    finished.set_result(value)
    return finished
