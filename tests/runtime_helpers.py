"""Reading a ring slot from Python, for the runtime's protocol tests: the descriptor's dtype (from
the field offsets and sizes the extension exports) and a parsed slot."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fabric_gpu import _runtime
from fabric_gpu.engines.base import PaddedBatch

# csrc/protocol.h's BatchDescriptor, from the field offsets and sizes the extension exports.
DESCRIPTOR_DTYPE = np.dtype(
    {
        "names": [name for name, _, _ in _runtime.DESCRIPTOR_FIELDS],
        "formats": [f"<u{size}" for _, _, size in _runtime.DESCRIPTOR_FIELDS],
        "offsets": [offset for _, offset, _ in _runtime.DESCRIPTOR_FIELDS],
        "itemsize": _runtime.DESCRIPTOR_BYTES,
    }
)


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
