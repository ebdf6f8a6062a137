"""A BERT-architecture checkpoint read straight onto the device, without transformers.

The packed and padded BERT forwards need only a few numbers of the model's config.json and its
weight tensors. Importing transformers and building its module cost most of a worker's start
(on the H200 machine a fresh process took ~14.5 s to import transformers 5's AutoModel, of which
torch itself ~4.3 s), so BERT checkpoints are read here instead: config.json with `json`, the
weights with safetensors (or `torch.load` for pytorch_model.bin) directly onto the device in
their stored dtype, cast once. Anything this reader does not recognise returns None and the
caller loads the model through transformers as before.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from fabric_gpu.model import weights_file

SUPPORTED_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")


class UnsupportedModelError(TypeError):
    """A model the packed forward cannot run (another architecture, another activation, ...)."""


@dataclass(frozen=True)
class BertShape:
    """What the BERT forwards read from a model's config."""

    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int
    layer_norm_eps: float
    pad_token_id: int

    @classmethod
    def of(cls, config: object) -> BertShape:
        """From a transformers config or config.json's mapping; raises UnsupportedModelError
        for anything the packed forward does not run."""

        def get(name: str, default: object = None) -> object:
            if isinstance(config, Mapping):
                return config.get(name, default)
            return getattr(config, name, default)

        model_type = get("model_type", "")
        if model_type != "bert":
            raise UnsupportedModelError(
                f"packed forward supports BERT-architecture models, not {model_type!r}"
            )
        if get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError("packed forward needs absolute position embeddings")
        activation = get("hidden_act", "gelu")
        if activation not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported activation {activation!r}")
        return cls(
            hidden_size=int(get("hidden_size")),  # type: ignore[call-overload]
            num_attention_heads=int(get("num_attention_heads")),  # type: ignore[call-overload]
            num_hidden_layers=int(get("num_hidden_layers")),  # type: ignore[call-overload]
            layer_norm_eps=float(get("layer_norm_eps", 1e-12)),  # type: ignore[arg-type]
            pad_token_id=int(get("pad_token_id", 0) or 0),  # type: ignore[call-overload]
        )


def bert_tensor_names(layers: int) -> list[str]:
    """The BertModel state-dict names the forwards read (the pooler is not among them)."""
    names = [
        "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
        "embeddings.LayerNorm.weight",
        "embeddings.LayerNorm.bias",
    ]
    per_layer = [
        f"attention.self.{part}.{kind}"
        for part in ("query", "key", "value")
        for kind in ("weight", "bias")
    ] + [
        f"{block}.{kind}"
        for block in (
            "attention.output.dense",
            "attention.output.LayerNorm",
            "intermediate.dense",
            "output.dense",
            "output.LayerNorm",
        )
        for kind in ("weight", "bias")
    ]
    names += [f"encoder.layer.{i}.{name}" for i in range(layers) for name in per_layer]
    return names


def read_bert_checkpoint(
    model_dir: Path, device: torch.device, dtype: torch.dtype
) -> tuple[BertShape, dict[str, torch.Tensor]] | None:
    """The config's shape and the forwards' tensors (BertModel names, on `device` in `dtype`),
    or None where this is not a BERT checkpoint this reader knows how to read."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        shape = BertShape.of(config)
    except (OSError, ValueError, TypeError):  # TypeError: UnsupportedModelError, bad numbers
        return None
    stored = _load_tensors(weights_file(model_dir), device)
    if stored is None:
        return None
    tensors = _bert_model_names(stored)
    wanted = bert_tensor_names(shape.num_hidden_layers)
    if any(name not in tensors for name in wanted):
        return None  # an unusual layout: transformers knows more of them
    return shape, {name: tensors[name].to(dtype) for name in wanted}


def _load_tensors(path: Path, device: torch.device) -> dict[str, torch.Tensor] | None:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        # A CUDA device given by type only ("cuda") is the current device, as torch means it.
        return load_file(str(path), device=str(device))
    loaded = torch.load(path, map_location=device, weights_only=True)
    return loaded if isinstance(loaded, dict) else None


def _bert_model_names(stored: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names as a bare BertModel's: task models save it under `bert.`, and old
    checkpoints call LayerNorm's parameters gamma and beta."""
    prefixed = "bert.embeddings.word_embeddings.weight" in stored
    renamed = {}
    for name, tensor in stored.items():
        if prefixed:
            if not name.startswith("bert."):
                continue  # the task head's own tensors
            name = name[len("bert.") :]
        if name.endswith(".gamma"):
            name = name[: -len("gamma")] + "weight"
        elif name.endswith(".beta"):
            name = name[: -len("beta")] + "bias"
        renamed[name] = tensor
    return renamed
