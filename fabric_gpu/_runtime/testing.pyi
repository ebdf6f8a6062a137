"""
Test-only bindings: Python stages, the self-test source and stage, descriptor packing, the ring on its own, and fault injection on the emulated GPU.
"""

from collections.abc import Callable

import fabric_gpu._runtime

def pack_descriptor(fields: dict) -> bytes:
    """The descriptor's bytes (csrc/protocol.h) from a dict of every field."""

def unpack_descriptor(data: bytes) -> dict:
    """A descriptor's fields from its bytes (the inverse of pack_descriptor)."""

class ByteRing:
    def __init__(self, capacity: int, alignment: int) -> None: ...
    def try_reserve(self, length: int) -> tuple[int, int, int, int] | None:
        """
        (begin, span, offset, length) of a reservation, or None while it does not fit.
        """

    def release(self, begin: int, span: int, offset: int, length: int) -> None: ...
    @property
    def used(self) -> int: ...
    @property
    def head(self) -> int: ...
    @property
    def tail(self) -> int: ...
    @property
    def capacity(self) -> int: ...

def set_python_stage(runtime: fabric_gpu._runtime.Runtime, fn: Callable) -> None:
    """
    Before start(): the stage is fn(publish_seq, batch_id, slot: uint8[], out: uint8[]), run in stream order on the emulated GPU; an exception fails that batch.
    """

def set_selftest_source(runtime: fabric_gpu._runtime.Runtime, seed: int) -> None:
    """Before start(): seeded random items and tokens (csrc/sources.h)."""

def set_selftest_stage(runtime: fabric_gpu._runtime.Runtime) -> None:
    """
    Before start(): the protocol tests' checksum-and-fill stage (csrc/stages.h).
    """

def inject_gpu_fault(runtime: fabric_gpu._runtime.Runtime, call: str, nth: int = 1) -> None:
    """
    After start(), on the emulated GPU: the nth call of `call` (wait_geq, write_value, launch, host_call, copy_to_host, record_event, record_mark) from now fails as a driver call would.
    """
