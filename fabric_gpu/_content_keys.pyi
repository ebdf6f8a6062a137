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
    implementation: str = "auto",
) -> bytes:
    """
    The 32-byte sha256 of prefix + data[offsets[i]:offsets[i+1]] for each i, joined. implementation: 'auto' (the CPU's SHA extensions where it has them), 'portable' or 'sha-extensions'.
    """

def sha_extensions() -> bool:
    """Whether this CPU has the SHA extensions digest_runs uses where it can."""
