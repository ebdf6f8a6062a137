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
from fabric_gpu.engines.base import (
    DeviceEngine,
    Engine,
    EngineError,
    HostEngine,
    InputLocation,
)
from fabric_gpu.variants import FLOAT32, Variant, stored_rows


@dataclass(frozen=True)
class OutputLayout:
    """Where a batch's outputs sit in its payload-ring region (sizes known to the CPU).

    [pooled items x row][hook layer 1: float16 real_tokens x hidden][hook layer 2]...

    A pooled row is float32 x hidden, or the engine's output variant of it (fabric_gpu/variants.py:
    fewer dimensions, float16, int8 or packed sign bits).
    """

    items: int
    real_tokens: int
    hidden: int
    layers: tuple[int, ...]
    hook_dtype: str = "float16"  # float16 or bfloat16 (2 bytes), or float32
    pooled_variant: Variant = FLOAT32

    @property
    def pooled_bytes(self) -> int:
        return self.items * self.pooled_variant.transport_row_bytes(self.hidden)

    @property
    def hook_itemsize(self) -> int:
        return 4 if self.hook_dtype == "float32" else 2

    @property
    def hook_bytes(self) -> int:
        return self.real_tokens * self.hidden * self.hook_itemsize

    @property
    def total_bytes(self) -> int:
        return self.pooled_bytes + len(self.layers) * self.hook_bytes

    def read(self, data: np.ndarray, copy: bool = True) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """Pooled rows [items, ...] (float32 [items, hidden], or the variant's encoding) and hooks
        [real_tokens, hidden] per layer (bfloat16 is widened to float32). Without `copy`, views
        of `data`, valid only during the sink call."""
        variant = self.pooled_variant
        rows = data[: self.pooled_bytes].reshape(self.items, -1)
        row_bytes = variant.row_bytes(self.hidden)
        if rows.shape[1] != row_bytes:  # rows travel padded to 16 bytes: drop the padding
            rows = np.ascontiguousarray(rows[:, :row_bytes])
        pooled = rows.view(variant.numpy_dtype)
        hooks = {}
        at = self.pooled_bytes
        for layer in self.layers:
            chunk = data[at : at + self.hook_bytes]
            if self.hook_dtype == "bfloat16":
                states = (chunk.view("<u2").astype(np.uint32) << 16).view("<f4")
            else:
                states = chunk.view("<f2" if self.hook_dtype == "float16" else "<f4")
                states = states.copy() if copy else states
            hooks[layer] = states.reshape(self.real_tokens, self.hidden)
            at += self.hook_bytes
        return (pooled.copy() if copy else pooled), hooks


@dataclass(frozen=True)
class BatchResult:
    batch_id: int
    publish_seq: int
    pooled: np.ndarray | None
    hooks: dict[int, np.ndarray]
    lengths: np.ndarray
    error: str  # "" when the engine succeeded


ResultFn = Callable[[BatchResult], None]


class _Runner:
    """What both runners share: submitting batches by task rows, and the drain-side sink that
    turns each batch's output bytes into a BatchResult for `on_result`."""

    _rt: _runtime.Runtime | None

    def __init__(
        self,
        hidden: int,
        layers: tuple[int, ...],
        hook_dtype: str,
        tokens: np.ndarray,
        offsets: np.ndarray,
        on_result: ResultFn,
        copy_outputs: bool,
        variant: Variant = FLOAT32,
    ) -> None:
        self.hidden = hidden
        self.variant = variant
        self.layers = layers
        self.hook_dtype = hook_dtype
        self._on_result = on_result
        self._copy = copy_outputs
        self._pending: dict[int, OutputLayout] = {}
        self._lengths: dict[int, np.ndarray] = {}
        self._error: BaseException | None = None
        self._tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self._offsets = np.ascontiguousarray(offsets, dtype=np.int64)

    def layout(self, items: int, real_tokens: int) -> OutputLayout:
        return OutputLayout(
            items, real_tokens, self.hidden, self.layers, self.hook_dtype, self.variant
        )

    # -- the drain thread (GIL held) --------------------------------------------------------
    def _sink(self, seq: int, batch_id: int, data: np.ndarray, error: str) -> None:
        layout = self._pending.pop(batch_id)
        lengths = self._lengths.pop(batch_id)
        if self._error is not None:
            return
        try:
            if error:
                result = BatchResult(batch_id, seq, None, {}, lengths, error)
            else:
                pooled, hooks = layout.read(data, copy=self._copy)
                result = BatchResult(batch_id, seq, pooled, hooks, lengths, "")
            self._on_result(result)
        except BaseException as exc:  # kept for the caller's thread; the drain must go on
            self._error = exc

    # -- caller API -------------------------------------------------------------------------
    def submit(self, batch_id: int, rows: np.ndarray, shape: int) -> None:
        """Queue one batch of task rows for shape epoch `shape` (the ledger's seq_len: the
        padded length, or the packed token capacity); blocks while the rings are full."""
        self._raise_kept()
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        lengths = self._offsets[rows + 1] - self._offsets[rows]
        layout = self.layout(rows.size, int(lengths.sum()))
        runtime = self._runtime()
        # Recorded before the call, because the drain's sink may take the batch before submit()
        # returns here; taken back if the runtime refuses it, which leaves nothing to drain.
        self._pending[batch_id] = layout
        self._lengths[batch_id] = lengths
        try:
            runtime.submit(
                batch_id=batch_id,
                rows=rows,
                bucket_max=shape,
                real_tokens=layout.real_tokens,
                output_bytes=layout.total_bytes,
                shape_epoch=shape,
                hooks=1 + len(self.layers),
            )
        except BaseException:
            self._pending.pop(batch_id, None)
            self._lengths.pop(batch_id, None)
            raise

    def finish(self) -> _runtime.RuntimeStats:
        self._runtime().finish()
        self._raise_kept()
        return self._runtime().stats()

    def close(self) -> None:
        """Stop the runtime's threads; drop it, which breaks the runner <-> runtime cycle."""
        if self._rt is not None:
            self._rt.shutdown()
            self._rt = None

    def _runtime(self) -> _runtime.Runtime:
        if self._rt is None:
            raise RuntimeError("the engine runner is closed")
        return self._rt

    def __enter__(self) -> _Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raise_kept(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class EngineRunner(_Runner):
    """An engine that runs on the CPU, behind a runtime on the emulated GPU.

    The runtime's graph stage drives it exactly as it drives a GPU engine: per batch, the gather
    kernel fills the engine's static inputs from the ring slot, the engine runs (here a host
    function in stream order, where a GPU runs the shape's CUDA graph), and the hook-copy kernels
    move pooled rows and real-token hidden states into the payload ring. One shape epoch per
    bucket length. `on_result` runs on the drain thread, in submission order; an exception it
    raises is kept and re-raised by the next `submit` or `finish`.
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
        copy_outputs: bool = True,
        poison: bool = False,
    ) -> None:
        variant = engine.manifest.hooks.output_variant()
        super().__init__(
            engine.hidden_size, tuple(engine.manifest.hooks.layers), "float16", tokens, offsets,
            on_result, copy_outputs, variant,
        )  # fmt: skip
        check_calibrated(engine)
        profile = engine.profile
        hidden = engine.hidden_size
        self.engine = engine
        # The engine's static buffers, shared by every shape (one batch runs at a time).
        capacity, items_max = profile.max_batch_tokens, profile.max_batch_items
        self._ids = np.zeros(capacity, np.int64)
        self._mask = np.zeros(capacity, np.int64)
        # Pooled rows in the output variant's bytes, each padded to 16 (the copies' unit).
        self._pooled = np.zeros((items_max, variant.transport_row_bytes(hidden)), np.uint8)
        self._hooks = {layer: np.zeros((capacity, hidden), np.float16) for layer in self.layers}
        max_output = self.layout(items_max, capacity).total_bytes
        slot_max = _runtime.slot_bytes(items_max, capacity)
        self._rt = _runtime.Runtime(
            emulated=True,  # engines that run on the CPU run in stream order on the emulated GPU
            device=0,
            config=_runtime.RuntimeConfig(
                ring_bytes=_round_up(max(ring_bytes, 2 * slot_max + 4096), 256),
                payload_ring_bytes=_round_up(2 * max_output + 4096, 256),
                max_output_bytes=max_output,
                max_items=items_max,
                max_in_flight=max_in_flight,
                staging_buffers=2,
                input_location="host",
                write_combined=False,  # the CPU reads these inputs: ordinary memory
                poison_byte=0xFF if poison else -1,
            ),
        )
        self._rt.set_token_table(self._tokens, self._offsets)
        self._rt.set_graph_stage()
        g = profile.seq_granularity
        for seq_len in range(g, profile.max_seq_len + 1, g):
            shape = _runtime.ShapeGraph(
                epoch=seq_len,
                items=min(items_max, capacity // seq_len),
                seq_len=seq_len,
                inputs=_runtime.PaddedInputs(
                    input_ids=self._ids.ctypes.data, attention_mask=self._mask.ctypes.data
                ),
                pooled=self._pooled.ctypes.data,
                pooled_row_bytes=self._pooled.shape[1],
                hooks=[self._hooks[layer].ctypes.data for layer in self.layers],
                hook_row_bytes=hidden * 2,
                pad_id=pad_token_id,
            )
            self._rt.add_shape(shape, host_fn=self._host_graph(seq_len))
        self._rt.set_sink(self._sink)
        self._rt.start()

    def _host_graph(self, seq_len: int) -> Callable[[int, int], None]:
        """The "graph" of one shape on the emulated GPU: the engine on the static buffers."""

        def run(publish_seq: int, items: int) -> None:
            n = items * seq_len
            ids = self._ids[:n].reshape(items, seq_len)
            lengths = self._mask[:n].reshape(items, seq_len).sum(axis=1)
            pooled, hidden = self.engine.forward_hidden(ids, lengths)
            # The variant by its CPU twin: the bytes a GPU engine would have made.
            if self.variant.key_suffix:
                calibration = (
                    self.engine.int8_calibration if self.variant.needs_calibration() else None
                )
                pooled = self.variant.apply_numpy(pooled, calibration)
            encoded = stored_rows(np.ascontiguousarray(pooled, dtype=self.variant.numpy_dtype))
            self._pooled[:items, : encoded.shape[1]] = encoded
            for layer in self.layers:
                self._hooks[layer][:n] = hidden[layer].reshape(n, -1)

        return run


class GpuEngineRunner(_Runner):
    """A GPU engine (torch) behind a runtime on the real GPU: the engine's CUDA graphs, one per
    shape the plan needs, captured before the runtime starts and launched by its graph stage."""

    def __init__(
        self,
        engine: DeviceEngine,
        tokens: np.ndarray,
        offsets: np.ndarray,
        on_result: ResultFn,
        *,
        shapes: list[tuple[int, int]],
        max_in_flight: int = 8,
        ring_bytes: int = 64 << 20,
        copy_outputs: bool = True,
        device: int = 0,
        poison: bool = False,
        measure_gpu_time: bool = False,
    ) -> None:
        super().__init__(
            engine.hidden_size, tuple(engine.manifest.hooks.layers), engine.hook_dtype, tokens,
            offsets, on_result, copy_outputs, engine.manifest.hooks.output_variant(),
        )  # fmt: skip
        check_calibrated(engine)
        self.engine = engine
        profile = engine.profile
        engine.capture(shapes)
        max_output = self.layout(profile.max_batch_items, profile.max_batch_tokens).total_bytes
        slot_max = _runtime.slot_bytes(profile.max_batch_items, profile.max_batch_tokens)
        self._rt = _runtime.Runtime(
            emulated=False,
            device=device,
            config=_runtime.RuntimeConfig(
                ring_bytes=_round_up(max(ring_bytes, 4 * slot_max), 256),
                # Eight batches of outputs: the drain can fall a few batches behind (a slow
                # sink) before the GPU waits for it.
                payload_ring_bytes=_round_up(8 * max_output, 256),
                max_output_bytes=max_output,
                max_items=profile.max_batch_items,
                max_in_flight=max_in_flight,
                staging_buffers=4,
                input_location="device",
                write_combined=True,  # the GPU reads the ring; the host only writes it
                poison_byte=0xFF if poison else -1,
                measure_gpu_time=measure_gpu_time,
            ),
        )
        self._rt.set_token_table(self._tokens, self._offsets)
        self._rt.set_graph_stage()
        for shape in engine.shapes():
            self._rt.add_shape(shape)
        self._rt.set_sink(self._sink)
        self._rt.start()


def open_runner(
    engine: Engine,
    tokens: np.ndarray,
    offsets: np.ndarray,
    on_result: ResultFn,
    *,
    shapes: list[tuple[int, int]],
    pad_token_id: int = 0,
    max_in_flight: int = 4,
    measure_gpu_time: bool = False,
) -> _Runner:
    """The runner for `engine`: engines that read on the CPU run on the emulated GPU; engines
    that read on the GPU get their `shapes` (epoch, rows) captured as CUDA graphs first, and with
    `measure_gpu_time` their stats count the GPU's busy seconds and its span (two timing marks
    per batch)."""
    if engine.input_location is InputLocation.HOST and hasattr(engine, "forward_hidden"):
        return EngineRunner(
            cast(HostEngine, engine),
            tokens,
            offsets,
            on_result,
            pad_token_id=pad_token_id,
            max_in_flight=max_in_flight,
        )
    if hasattr(engine, "capture") and hasattr(engine, "shapes"):
        return GpuEngineRunner(
            cast(DeviceEngine, engine), tokens, offsets, on_result, shapes=shapes,
            max_in_flight=max(max_in_flight, 8), measure_gpu_time=measure_gpu_time,
        )  # fmt: skip
    raise NotImplementedError(f"{type(engine).__name__} can be driven by no runner")


def check_calibrated(engine: Engine) -> None:
    """An int8 engine quantises with a calibration it must have been given first."""
    variant = engine.manifest.hooks.output_variant()
    if variant.needs_calibration() and engine.int8_calibration is None:
        raise EngineError(
            f"variant {variant.label}: the engine has no int8 calibration; give it one with "
            "set_int8_calibration (an extraction run makes and records one per model key)"
        )


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def selftest(**kwargs: Any) -> dict[str, Any]:
    """Push random batches through the whole protocol and verify every byte (see csrc/selftest.h)."""
    return dict(_runtime.selftest(**kwargs))
