"""A model folder's own defaults, read from its sentence-transformers files where present, so that
an engine configured without overrides gives `SentenceTransformer(folder).encode()`'s vectors:

- `sentence_bert_config.json`: `max_seq_length` (encode() truncates there) and `do_lower_case`;
- `modules.json`: a `Normalize` module (unit-length vectors) and where the pooling config is;
- that pooling config (`1_Pooling/config.json`): the pooling mode, and `include_prompt` (false:
  encode() leaves a prompt's tokens out of the pooling, which the engines do not do, so a prompt
  is refused for such a model: `prompt_pooling_error`);
- `config_sentence_transformers.json`: named prompts and the default prompt's name.

A folder without these files (a plain Hugging Face model) gets mean pooling, no normalisation,
and the model's own length limit (`max_position_embeddings`, or the tokenizer's
`model_max_length`), capped at 512.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_DEFAULT_SEQ_LEN = 512

# sentence-transformers' pooling modes, and the product's name for those it computes.
_POOLING_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}


class ModelDefaultsError(ValueError):
    """The folder asks for something the engines do not compute; the message says what to set."""


@dataclass(frozen=True)
class ModelDefaults:
    max_seq_len: int
    pooling: str | None  # None: the folder's pooling is one the engines do not compute
    normalize: bool
    do_lower_case: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    source: str = "model config"  # which files they came from, for messages and receipts
    pooling_refused: str = ""  # why `pooling` is None
    include_prompt: bool = True  # the pooling config's: False leaves prompt tokens out of pooling

    def default_pooling(self) -> str:
        """The pooling to use when none is set; an error saying what to set where the folder's
        own is not one the engines compute."""
        if self.pooling is None:
            raise ModelDefaultsError(self.pooling_refused)
        return self.pooling

    def prompt_pooling_error(self, prompt: str, model: str) -> str | None:
        """Why `prompt` cannot be used with this model, or None. encode() pools such a model
        without the prompt's tokens; the engines pool every token, so they would give other
        vectors, silently: refused instead, saying what to do."""
        if not prompt or self.include_prompt:
            return None
        return (
            f"{model}: its pooling config sets include_prompt false (encode() leaves the "
            f"prompt's tokens out of the pooled vector), which the engines do not compute; "
            f"submit this set without a prompt (it would be {prompt!r}), or use a copy of the "
            "model whose pooling config sets include_prompt true, knowing its vectors then "
            "differ from encode()'s"
        )


def model_defaults(model_dir: Path) -> ModelDefaults:
    st_config = _json(model_dir / "sentence_bert_config.json")
    modules = _json(model_dir / "modules.json") or []
    st_meta = _json(model_dir / "config_sentence_transformers.json") or {}
    sources = [
        name
        for name in ("sentence_bert_config.json", "modules.json")
        if (model_dir / name).is_file()
    ]
    max_seq_len = (st_config or {}).get("max_seq_length") or _model_limit(model_dir)
    pooling, refused = _pooling(model_dir, modules)
    return ModelDefaults(
        include_prompt=_include_prompt(model_dir, modules),
        max_seq_len=int(max_seq_len),
        pooling=pooling,
        pooling_refused=refused,
        normalize=any(str(m.get("type", "")).endswith(".Normalize") for m in modules),
        do_lower_case=bool((st_config or {}).get("do_lower_case", False)),
        prompts={str(k): str(v) for k, v in (st_meta.get("prompts") or {}).items()},
        default_prompt_name=st_meta.get("default_prompt_name") or None,
        source=", ".join(sources) or "config.json",
    )


def _pooling(model_dir: Path, modules: list[dict[str, Any]]) -> tuple[str | None, str]:
    """(the folder's pooling, "") or (None, why the engines cannot compute it)."""
    pooling_module = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling_module is None:
        return "mean", ""
    config = _json(model_dir / str(pooling_module.get("path", "")) / "config.json") or {}
    if "pooling_mode" in config:  # newer sentence-transformers write the mode by name
        config = {f"pooling_mode_{config['pooling_mode']}": True}
    chosen = [mode for mode in _POOLING_MODES if config.get(mode)]
    if not chosen:
        return "mean", ""
    if len(chosen) > 1 or _POOLING_MODES[chosen[0]] is None:
        return None, (
            f"{model_dir}: its pooling ({', '.join(chosen)}) is not one the engines compute "
            "(mean, cls, last); set the pooling explicitly (manifest hooks.pooling, or "
            "--pooling) to use this model"
        )
    return _POOLING_MODES[chosen[0]], ""


def _include_prompt(model_dir: Path, modules: list[dict[str, Any]]) -> bool:
    pooling_module = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling_module is None:
        return True
    config = _json(model_dir / str(pooling_module.get("path", "")) / "config.json") or {}
    return bool(config.get("include_prompt", True))


def _model_limit(model_dir: Path) -> int:
    config = _json(model_dir / "config.json") or {}
    tokenizer = _json(model_dir / "tokenizer_config.json") or {}
    limits = [
        int(v)
        for v in (config.get("max_position_embeddings"), tokenizer.get("model_max_length"))
        if isinstance(v, int) and v > 0
    ]
    if config.get("model_type") in ("roberta", "xlm-roberta", "camembert") and limits:
        limits[0] -= 2  # their positions start after the padding index
    return min([MAX_DEFAULT_SEQ_LEN, *limits])


def _json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelDefaultsError(f"{path}: not readable JSON ({exc}); repair or remove it") from exc
