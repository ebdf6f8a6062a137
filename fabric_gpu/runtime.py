"""The Python face of the compiled runtime (csrc/runtime.*): an engine driven batch by batch.

`EngineRunner` owns one runtime around one engine. The caller submits batches (task rows of a
tokenised task set, by reference: the filler thread gathers their tokens straight from the
memory-mapped token array into the ring); results come back on the drain thread through
`on_result`, in submission order. The same code path runs in CI and on a GPU: engines that read
their inputs on the CPU (the reference engine) run on the emulated GPU, whose streams are host
threads honouring the same doorbell and publication protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

import fabric_gpu._runtime as _runtime
from fabric_gpu.engines.base import Engine, HostEngine, InputLocation, PaddedBatch

# The layout of csrc/protocol.h's BatchDescriptor (128 bytes).
DESCRIPTOR_DTYPE = np.dtype(
    [
        ("batch_id", "<u8"),
        ("publish_seq", "<u8"),
        ("real_tokens", "<u8"),
        ("padded_tokens", "<u8"),
        ("output_limit", "<u8"),
        ("offsets_at", "<u4"),
        ("tokens_at", "<u4"),
        ("lane", "<u4"),
        ("batch_class", "<u4"),
        ("bucket_max", "<u4"),
        ("item_count", "<u4"),
        ("shape_epoch", "<u4"),
        ("payload_bytes", "<u4"),
        ("reserved", "<u8", (7,)),
    ]
)
assert DESCRIPTOR_DTYPE.itemsize == _runtime.DESCRIPTOR_BYTES


@dataclass(frozen=True)
class Slot:
    """A batch's payload as the engine sees it: descriptor, item offsets, token ids."""

    descriptor: np.void
    offsets: np.ndarray  # int64 [items + 1], into `tokens`
    tokens: np.ndarray  # int32 [real_tokens]

    @classmethod
    def parse(cls, slot: np.ndarray) -> Slot:
        d = slot[: DESCRIPTOR_DTYPE.itemsize].view(DESCRIPTOR_DTYPE)[0]
        items, real = int(d["item_count"]), int(d["real_tokens"])
        offsets_at, tokens_at = int(d["offsets_at"]), int(d["tokens_at"])
        offsets = slot[offsets_at : offsets_at + 8 * (items + 1)].view(np.int64)
        tokens = slot[tokens_at : tokens_at + 4 * real].view(np.int32)
        return cls(d, offsets, tokens)

    def padded(self, pad_id: int = 0) -> PaddedBatch:
        seq_len = int(self.descriptor["bucket_max"])
        lengths = np.diff(self.offsets)
        positions = np.arange(seq_len)[None, :]
        real = positions < lengths[:, None]
        ids = np.full((lengths.size, seq_len), pad_id, dtype=np.int64)
        ids[real] = self.tokens[(self.offsets[:-1, None] + positions)[real]]
        return PaddedBatch(input_ids=ids, lengths=lengths)


@dataclass(frozen=True)
class OutputLayout:
    """Where a batch's outputs sit in its payload-ring region (sizes known to the CPU).

    [pooled float32 items x hidden][hook layer 1: float16 real_tokens x hidden][hook layer 2]...
    """

    items: int
    real_tokens: int
    hidden: int
    layers: tuple[int, ...]

    @property
    def pooled_bytes(self) -> int:
        return self.items * self.hidden * 4

    @property
    def hook_bytes(self) -> int:
        return self.real_tokens * self.hidden * 2

    @property
    def total_bytes(self) -> int:
        return self.pooled_bytes + len(self.layers) * self.hook_bytes

    def write(self, out: np.ndarray, pooled: np.ndarray, hooks: dict[int, np.ndarray]) -> None:
        out[: self.pooled_bytes] = (
            np.ascontiguousarray(pooled, dtype="<f4").view(np.uint8).reshape(-1)
        )
        at = self.pooled_bytes
        for layer in self.layers:
            states = np.ascontiguousarray(hooks[layer], dtype="<f2").view(np.uint8).reshape(-1)
            out[at : at + self.hook_bytes] = states
            at += self.hook_bytes

    def read(self, data: np.ndarray) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """Copies out of `data` (which is only valid during the sink call)."""
        pooled = data[: self.pooled_bytes].view("<f4").reshape(self.items, self.hidden).copy()
        hooks = {}
        at = self.pooled_bytes
        for layer in self.layers:
            chunk = data[at : at + self.hook_bytes].view("<f2")
            hooks[layer] = chunk.reshape(self.real_tokens, self.hidden).copy()
            at += self.hook_bytes
        return pooled, hooks


@dataclass(frozen=True)
class BatchResult:
    batch_id: int
    publish_seq: int
    pooled: np.ndarray | None
    hooks: dict[int, np.ndarray]
    lengths: np.ndarray
    error: str  # "" when the engine succeeded


ResultFn = Callable[[BatchResult], None]


class EngineRunner:
    """One engine behind one runtime. Use as a context manager; `finish()` waits for the drain.

    The runtime's graph stage drives the engine: per batch, the gather kernel fills the engine's
    static inputs from the ring slot, the engine runs (its CUDA graph for that shape; on the
    emulated GPU, a host function), and the hook-copy kernels move pooled rows and real-token
    hidden states into the payload ring. One shape epoch per bucket length.

    `on_result` runs on the runtime's drain thread, in submission order; an exception it raises
    is kept and re-raised by the next `submit` or `finish`.
    """

    def __init__(
        self,
        engine: HostEngine,
        tokens: np.ndarray,
        offsets: np.ndarray,
        on_result: ResultFn,
        *,
        pad_token_id: int = 0,
        max_in_flight: int = 4,
        ring_bytes: int = 16 << 20,
    ) -> None:
        profile = engine.profile
        hidden = engine.hidden_size
        self.engine = engine
        self.layers = tuple(engine.manifest.hooks.layers)
        self._on_result = on_result
        self._pending: dict[int, OutputLayout] = {}
        self._lengths: dict[int, np.ndarray] = {}
        self._error: BaseException | None = None
        self._tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self._offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        # The engine's static buffers, shared by every shape (one batch runs at a time).
        capacity, items_max = profile.max_batch_tokens, profile.max_batch_items
        self._ids = np.zeros(capacity, np.int64)
        self._mask = np.zeros(capacity, np.int64)
        self._pooled = np.zeros((items_max, hidden), np.float32)
        self._hooks = {layer: np.zeros((capacity, hidden), np.float16) for layer in self.layers}
        max_output = OutputLayout(items_max, capacity, hidden, self.layers).total_bytes
        slot_max = _runtime.slot_bytes(items_max, capacity)
        self._rt: Any = _runtime.Runtime(
            emulated=True,  # engines that run on the CPU run in stream order on the emulated GPU
            device=0,
            config={
                "ring_bytes": _round_up(max(ring_bytes, 2 * slot_max + 4096), 256),
                "payload_ring_bytes": _round_up(2 * max_output + 4096, 256),
                "max_output_bytes": max_output,
                "max_items": items_max,
                "max_in_flight": max_in_flight,
                "staging_buffers": 2,
                "input_location": "host",
                "write_combined": False,  # the CPU reads these inputs: ordinary memory
            },
        )
        self._rt.set_token_table(self._tokens, self._offsets)
        self._rt.set_graph_stage()
        g = profile.seq_granularity
        for seq_len in range(g, profile.max_seq_len + 1, g):
            self._rt.add_shape(
                epoch=seq_len,
                layout="padded",
                items=min(items_max, capacity // seq_len),
                seq_len=seq_len,
                pad_id=pad_token_id,
                graph_exec=0,
                host_fn=self._host_graph(seq_len),
                input_ids=self._ids.ctypes.data,
                aux0=self._mask.ctypes.data,
                aux1=0,
                aux2=0,
                pooled=self._pooled.ctypes.data,
                pooled_row_bytes=hidden * 4,
                hooks=[self._hooks[layer].ctypes.data for layer in self.layers],
                hook_row_bytes=hidden * 2,
            )
        self._rt.set_sink(self._sink)
        self._rt.start()

    # -- runtime callbacks (runtime threads, GIL held) --------------------------------------
    def _host_graph(self, seq_len: int) -> Callable[[int, int], None]:
        """The "graph" of one shape on the emulated GPU: the engine on the static buffers."""

        def run(publish_seq: int, items: int) -> None:
            n = items * seq_len
            ids = self._ids[:n].reshape(items, seq_len)
            lengths = self._mask[:n].reshape(items, seq_len).sum(axis=1)
            pooled, hidden = self.engine.forward_hidden(ids, lengths)
            self._pooled[:items] = pooled
            for layer in self.layers:
                self._hooks[layer][:n] = hidden[layer].reshape(n, -1)

        return run

    def _sink(self, seq: int, batch_id: int, data: np.ndarray, error: str) -> None:
        layout = self._pending.pop(batch_id)
        lengths = self._lengths.pop(batch_id)
        if self._error is not None:
            return
        try:
            if error:
                result = BatchResult(batch_id, seq, None, {}, lengths, error)
            else:
                pooled, hooks = layout.read(data)
                result = BatchResult(batch_id, seq, pooled, hooks, lengths, "")
            self._on_result(result)
        except BaseException as exc:  # kept for the caller's thread; the drain must go on
            self._error = exc

    # -- caller API -------------------------------------------------------------------------
    def submit(self, batch_id: int, rows: np.ndarray, bucket_max: int) -> None:
        """Queue one batch (task rows, padded to `bucket_max`); blocks while the rings are full."""
        self._raise_kept()
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        lengths = self._offsets[rows + 1] - self._offsets[rows]
        layout = OutputLayout(rows.size, int(lengths.sum()), self.engine.hidden_size, self.layers)
        self._pending[batch_id] = layout
        self._lengths[batch_id] = lengths
        self._runtime().submit(
            batch_id=batch_id,
            rows=rows,
            bucket_max=bucket_max,
            real_tokens=layout.real_tokens,
            output_bytes=layout.total_bytes,
            shape_epoch=bucket_max,
            hooks=1 + len(self.layers),
        )

    def finish(self) -> dict[str, Any]:
        self._runtime().finish()
        self._raise_kept()
        return dict(self._runtime().stats())

    def close(self) -> None:
        """Stop the runtime's threads; drop it, which breaks the runner <-> runtime cycle."""
        if self._rt is not None:
            self._rt.shutdown()
            self._rt = None

    def _runtime(self) -> Any:
        if self._rt is None:
            raise RuntimeError("the engine runner is closed")
        return self._rt

    def __enter__(self) -> EngineRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raise_kept(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def open_runner(
    engine: Engine,
    tokens: np.ndarray,
    offsets: np.ndarray,
    on_result: ResultFn,
    *,
    pad_token_id: int = 0,
    max_in_flight: int = 4,
) -> EngineRunner:
    """The runner for `engine`: engines that read on the CPU run on the emulated GPU."""
    if engine.input_location is InputLocation.HOST and hasattr(engine, "forward_hidden"):
        return EngineRunner(
            cast(HostEngine, engine),
            tokens,
            offsets,
            on_result,
            pad_token_id=pad_token_id,
            max_in_flight=max_in_flight,
        )
    raise NotImplementedError(
        f"{type(engine).__name__} reads its inputs on the GPU; it needs a GPU engine runner"
    )


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def selftest(**kwargs: Any) -> dict[str, Any]:
    """Push random batches through the whole protocol and verify every byte (see csrc/selftest.h)."""
    return dict(_runtime.selftest(**kwargs))
