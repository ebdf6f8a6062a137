"""The four numbers a consumer (one engine on one device) describes itself with.

The broker plans batches for exactly these limits; an engine refuses batches outside them.
"""

from __future__ import annotations

from dataclasses import dataclass


class ProfileError(ValueError):
    """A consumer profile whose numbers contradict each other; the message names the field."""


LAYOUTS = ("padded", "packed")
PACKED_GRANULARITY = 512  # packed shapes: token capacities in steps of this many tokens


@dataclass(frozen=True)
class ConsumerProfile:
    max_batch_tokens: int  # padded tokens (items x bucket length, or the packed capacity)
    max_batch_items: int
    max_seq_len: int  # longest item, special tokens included
    seq_granularity: int  # bucket lengths are multiples of this
    # How the engine takes its input: "padded" [items, bucket length], or "packed" (all tokens
    # of a batch in one axis; the shape is the token count rounded up to PACKED_GRANULARITY).
    layout: str = "padded"

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_batch_items", "max_seq_len", "seq_granularity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ProfileError(f"{name} must be an integer, got {value!r}")
            if value <= 0:
                raise ProfileError(f"{name} must be positive, got {value}")
        if self.max_seq_len % self.seq_granularity != 0:
            raise ProfileError(
                f"max_seq_len ({self.max_seq_len}) must be a multiple of seq_granularity "
                f"({self.seq_granularity}) so the longest bucket is a real shape"
            )
        if self.max_seq_len >= 1 << 16:
            raise ProfileError(f"max_seq_len must be below 65,536, got {self.max_seq_len}")
        if self.layout not in LAYOUTS:
            raise ProfileError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "packed" and self.max_batch_tokens % PACKED_GRANULARITY != 0:
            raise ProfileError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be a multiple of "
                f"{PACKED_GRANULARITY} for a packed engine (its shapes are token capacities)"
            )
        if self.max_batch_tokens < self.max_seq_len:
            raise ProfileError(
                f"max_batch_tokens ({self.max_batch_tokens}) is smaller than max_seq_len "
                f"({self.max_seq_len}): the longest items would fit in no batch; raise "
                "max_batch_tokens or lower max_seq_len"
            )

    def with_layout(self, layout: str) -> ConsumerProfile:
        return ConsumerProfile(
            self.max_batch_tokens,
            self.max_batch_items,
            self.max_seq_len,
            self.seq_granularity,
            layout,
        )

    def bucket_length(self, n_tokens: int) -> int:
        """Padded length of an item of `n_tokens` tokens (rounded up to the granularity)."""
        g = self.seq_granularity
        return -(-n_tokens // g) * g
