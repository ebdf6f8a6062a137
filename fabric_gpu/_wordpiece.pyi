"""
BERT WordPiece for ASCII text on every core (see fabric_gpu/wordpiece.py).
"""

from collections.abc import Sequence
from typing import Annotated

import numpy
from numpy.typing import NDArray

class Encoder:
    def __init__(
        self,
        vocab: Sequence[tuple[str, int]],
        continuing_prefix: str,
        unk_id: int,
        max_chars_per_word: int,
        lowercase: bool,
        prefix_ids: Sequence[int],
        suffix_ids: Sequence[int],
        added_tokens: Sequence[str],
    ) -> None: ...
    def encode(
        self,
        offsets: Annotated[
            NDArray[numpy.int64], dict(shape=(None,), order="C", device="cpu", writable=False)
        ],
        data: Annotated[
            NDArray[numpy.uint8], dict(shape=(None,), order="C", device="cpu", writable=False)
        ],
        threads: int = 0,
    ) -> tuple:
        """
        (lengths int64, tokens int32) of the texts data[offsets[i]:offsets[i+1]]; length -1: handed back to the reference tokenizer
        """
