"""The fixed yardstick (../shared/bench/reference_extract.py), imported by path, and its random
encoders saved as model folders the product can load."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "bench" / "reference_extract.py"


def load_reference(path: str | Path = DEFAULT) -> Any:
    spec = importlib.util.spec_from_file_location("reference_extract", path)
    if spec is None or spec.loader is None or not Path(path).is_file():
        raise SystemExit(f"cannot import the yardstick from {path} (pass --reference)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)


def random_model(
    reference: Any, folder: Path, size: str, tokenizer_from: Path, dtype: Any = None
) -> Path:
    """The yardstick's random encoder of this size (fp16 unless `dtype`), saved as a model
    folder with all-MiniLM's tokenizer (the same vocabulary); kept if already saved there."""
    if (folder / "config.json").is_file():
        return folder
    reference.random_encoder(size, device="cpu", dtype=dtype).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder
