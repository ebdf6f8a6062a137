"""
SHA-256 of many byte runs on every core (see fabric_pipelines/lib/broker/reuse.py).
"""

from typing import Annotated

import numpy
from numpy.typing import NDArray

def digest_runs(
    prefix: bytes,
    data: Annotated[
        NDArray[numpy.uint8], dict(shape=(None,), order="C", device="cpu", writable=False)
    ],
    offsets: Annotated[
        NDArray[numpy.int64], dict(shape=(None,), order="C", device="cpu", writable=False)
    ],
    threads: int = 0,
) -> bytes:
    """
    The 32-byte sha256 of prefix + data[offsets[i]:offsets[i+1]] for each i, joined.
    """
