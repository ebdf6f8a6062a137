# Type stub of the compiled module fabric_gpu._wordpiece (csrc/wordpiece_module.cpp).
import numpy as np

class Encoder:
    def __init__(
        self,
        vocab: list[tuple[str, int]],
        continuing_prefix: str,
        unk_id: int,
        max_chars_per_word: int,
        lowercase: bool,
        prefix_ids: list[int],
        suffix_ids: list[int],
        added_tokens: list[str],
    ) -> None: ...
    def encode(
        self, offsets: np.ndarray, data: np.ndarray, threads: int = 0
    ) -> tuple[np.ndarray, np.ndarray]: ...
