"""The engine interface: one batch of token ids in, pooled embeddings and hook states out."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from fabric_gpu.manifest import EngineManifest
from fabric_gpu.profile import ConsumerProfile
from fabric_gpu.variants import Int8Calibration

if TYPE_CHECKING:
    from fabric_gpu._runtime import ShapeGraph


class InputLocation(enum.Enum):
    """Where an engine reads its inputs, which decides the memory the runtime gives it.

    DEVICE engines read on the GPU from write-combined mapped pinned memory. HOST engines read on
    the CPU and get ordinary memory: CPU reads of write-combined memory are very slow.
    """

    HOST = "host"
    DEVICE = "device"


@dataclass(frozen=True)
class PaddedBatch:
    """A shape-pure batch: `input_ids[items, seq_len]`, real lengths per item (the rest is pad)."""

    input_ids: np.ndarray  # int64 [items, seq_len]
    lengths: np.ndarray  # int64 [items], each <= seq_len

    @property
    def items(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())


def gather_padded(
    tokens: np.ndarray, offsets: np.ndarray, rows: np.ndarray, seq_len: int, pad_id: int
) -> PaddedBatch:
    """Scatter the items' tokens into a `[items, seq_len]` array padded with `pad_id`."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    positions = np.arange(seq_len, dtype=np.int64)[None, :]
    real = positions < lengths[:, None]
    ids = np.full((rows.size, seq_len), pad_id, dtype=np.int64)
    ids[real] = tokens[(starts[:, None] + positions)[real]]
    return PaddedBatch(input_ids=ids, lengths=lengths)


@dataclass(frozen=True)
class EngineOutput:
    """Results of one batch, items in batch order.

    `hooks[layer]` holds that layer's hidden states for real tokens only, items back to back:
    rows `offsets[i]:offsets[i+1]` belong to item i (offsets = cumulative lengths).
    """

    pooled: np.ndarray  # float32 [items, hidden]
    hooks: dict[int, np.ndarray]  # layer -> float16 [real_tokens, hidden]


class EngineError(RuntimeError):
    pass


class Engine(Protocol):
    """`forward` returns float32 pooled vectors; the runners' batches carry the manifest's
    output variant (hooks.variant), which an int8 engine makes with `int8_calibration`."""

    manifest: EngineManifest
    input_location: InputLocation
    hidden_size: int
    num_layers: int
    int8_calibration: Int8Calibration | None

    @property
    def profile(self) -> ConsumerProfile: ...

    def forward(self, batch: PaddedBatch) -> EngineOutput: ...

    def set_int8_calibration(self, calibration: Int8Calibration) -> None: ...

    def close(self) -> None: ...


class HostEngine(Engine, Protocol):
    """An engine that reads its inputs on the CPU and can return every position's hidden state:
    the runtime's graph stage runs it on the emulated GPU, on the stage's static buffers."""

    def forward_hidden(
        self, input_ids: np.ndarray, lengths: np.ndarray
    ) -> tuple[np.ndarray, dict[int, np.ndarray]]: ...


class DeviceEngine(Engine, Protocol):
    """An engine that reads its inputs on the GPU: it captures one CUDA graph per shape and
    describes each (static buffers, graph handle) for the runtime's graph stage."""

    hook_dtype: str

    def capture(self, shapes: list[tuple[int, int]]) -> None: ...

    def shapes(self) -> list[ShapeGraph]: ...


def check_batch(profile: ConsumerProfile, batch: PaddedBatch) -> None:
    """Refuse a batch outside the consumer's limits: the broker should never plan one."""
    if batch.items == 0:
        raise EngineError("empty batch")
    if batch.items > profile.max_batch_items:
        raise EngineError(
            f"batch has {batch.items} items > max_batch_items {profile.max_batch_items}"
        )
    if batch.seq_len > profile.max_seq_len:
        raise EngineError(f"batch seq_len {batch.seq_len} > max_seq_len {profile.max_seq_len}")
    if batch.items * batch.seq_len > profile.max_batch_tokens:
        raise EngineError(
            f"batch is {batch.items} x {batch.seq_len} padded tokens > max_batch_tokens "
            f"{profile.max_batch_tokens}"
        )


def normalise_layers(layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Map hook layer numbers (negative from the end) onto hidden_states indices 0..num_layers."""
    out = []
    for layer in layers:
        index = layer if layer >= 0 else num_layers + 1 + layer
        if not 0 <= index <= num_layers:
            raise EngineError(
                f"hook layer {layer} does not exist: the model has layers 0..{num_layers} "
                f"(0 = embeddings) or -1..-{num_layers + 1} from the end"
            )
        out.append(index)
    return tuple(out)
