"""The engine manifest: what an engine is, loaded fail-closed.

Nine fields, all required, none defaulted: a manifest that omits one, adds an unknown one, gives
one the wrong type, or names weights whose sha256 differs from the files on disk is refused with
an error naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fabric_gpu.profile import ConsumerProfile, ProfileError
from fabric_gpu.variants import Variant, VariantError

BACKENDS = ("cpu", "torch", "tensorrt")
DTYPES = ("float32", "float16", "bfloat16")
POOLINGS = ("mean", "cls", "last")

REQUIRED_FIELDS = (
    "model_id",
    "weights_sha256",
    "backend",
    "dtype",
    "max_batch_tokens",
    "max_batch_items",
    "max_seq_len",
    "seq_granularity",
    "hooks",
)


class ManifestError(ValueError):
    """A manifest that cannot be trusted; the message names the field and what to do."""


@dataclass(frozen=True)
class HookSpec:
    """Which layers' hidden states to keep (real tokens only) and how to pool the embedding.

    Layer k is the output of the k-th transformer layer (0 = the embeddings); negative counts
    from the last, as in Python.
    """

    layers: tuple[int, ...]
    pooling: str
    # Pooled vectors scaled to unit length; None: as the model folder says (a Normalize module).
    normalize: bool | None = None
    # The encoding the engine gives its pooled vectors before they leave the GPU
    # (fabric_gpu/variants.py): float32 (default), float16, int8 or binary, optionally `:DIMS`.
    variant: str = "float32"

    def to_mapping(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layers": list(self.layers), "pooling": self.pooling}
        if self.normalize is not None:
            out["normalize"] = self.normalize
        if self.variant != "float32":
            out["variant"] = self.variant
        return out

    def output_variant(self) -> Variant:
        """The variant, renormalising shortened vectors of a normalising model."""
        return Variant.parse(self.variant, normalize=bool(self.normalize))


@dataclass(frozen=True)
class EngineManifest:
    model_id: str
    weights_sha256: str
    backend: str
    dtype: str
    profile: ConsumerProfile
    hooks: HookSpec

    @property
    def model_key(self) -> str:
        """Identifies results of this model and pooling in the database: name@weights:pooling."""
        name = self.model_id.rstrip("/").rsplit("/", 1)[-1]
        normalized = "+normalized" if self.hooks.normalize else ""
        variant = self.hooks.output_variant().key_suffix  # e.g. "~int8:256"; float32: none
        return f"{name}@{self.weights_sha256[:12]}:{self.hooks.pooling}{normalized}{variant}"

    def receipt_model(self) -> dict[str, Any]:
        """What an index receipt records of the model its pooled vectors came from."""
        variant = {"variant": self.hooks.variant} if self.hooks.variant != "float32" else {}
        return {
            "model_id": self.model_id,
            "weights_sha256": self.weights_sha256,
            "pooling": self.hooks.pooling,
            "normalize": self.hooks.normalize,
            "max_seq_len": self.profile.max_seq_len,
            "layer": "pooled",
            "dtype": self.dtype,
            "backend": self.backend,
            **variant,
        }

    def to_mapping(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "weights_sha256": self.weights_sha256,
            "backend": self.backend,
            "dtype": self.dtype,
            "max_batch_tokens": self.profile.max_batch_tokens,
            "max_batch_items": self.profile.max_batch_items,
            "max_seq_len": self.profile.max_seq_len,
            "seq_granularity": self.profile.seq_granularity,
            "hooks": self.hooks.to_mapping(),
        }

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "manifest") -> EngineManifest:
        if not isinstance(data, Mapping):
            raise ManifestError(
                f"{source}: expected a mapping of the fields, got {type(data).__name__}"
            )
        missing = [f for f in REQUIRED_FIELDS if f not in data]
        if missing:
            raise ManifestError(
                f"{source}: missing required field(s) {', '.join(missing)}; "
                "every field must be given, none has a default"
            )
        unknown = sorted(set(data) - set(REQUIRED_FIELDS))
        if unknown:
            raise ManifestError(
                f"{source}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(REQUIRED_FIELDS)}"
            )

        def text(name: str, allowed: tuple[str, ...] | None = None) -> str:
            value = data[name]
            if not isinstance(value, str) or not value:
                raise ManifestError(
                    f"{source}: field {name} must be a non-empty string, got {value!r}"
                )
            if allowed is not None and value not in allowed:
                raise ManifestError(
                    f"{source}: field {name} is {value!r}; expected one of {allowed}"
                )
            return value

        sha = text("weights_sha256").lower()
        if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise ManifestError(
                f"{source}: field weights_sha256 must be 64 hex digits, got {sha!r}"
            )
        try:
            profile = ConsumerProfile(
                max_batch_tokens=data["max_batch_tokens"],
                max_batch_items=data["max_batch_items"],
                max_seq_len=data["max_seq_len"],
                seq_granularity=data["seq_granularity"],
            )
        except ProfileError as exc:
            raise ManifestError(f"{source}: {exc}") from exc
        return cls(
            model_id=text("model_id"),
            weights_sha256=sha,
            backend=text("backend", BACKENDS),
            dtype=text("dtype", DTYPES),
            profile=profile,
            hooks=_parse_hooks(data["hooks"], source, text("model_id")),
        )

    @classmethod
    def load(cls, path: Path) -> EngineManifest:
        """Read a manifest from JSON (or YAML, by suffix)."""
        raw = path.read_text(encoding="utf-8")
        try:
            if path.suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(raw)
            else:
                data = json.loads(raw)
        except Exception as exc:  # any parse error is the file's fault; say which file
            raise ManifestError(
                f"{path}: not valid {path.suffix.lstrip('.') or 'JSON'}: {exc}"
            ) from exc
        return cls.from_mapping(data, source=str(path))

    def verify_weights(self, actual_sha256: str) -> None:
        if actual_sha256 != self.weights_sha256:
            raise ManifestError(
                f"field weights_sha256: the manifest says {self.weights_sha256} but the weights of "
                f"{self.model_id} hash to {actual_sha256}; refusing to run a model other than the "
                "one the manifest names (update the manifest if the weights changed on purpose)"
            )


def _parse_hooks(value: Any, source: str, model_id: str) -> HookSpec:
    if not isinstance(value, Mapping) or not (
        {"layers", "pooling"} <= set(value) <= {"layers", "pooling", "normalize", "variant"}
    ):
        raise ManifestError(
            f"{source}: field hooks must be a mapping with 'layers' (list of ints), 'pooling' "
            f"({'/'.join(POOLINGS)}) and optionally 'normalize' (true/false) and 'variant' "
            f"(e.g. 'int8:256'), got {value!r}"
        )
    layers = value["layers"]
    if not isinstance(layers, list | tuple) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in layers
    ):
        raise ManifestError(
            f"{source}: field hooks.layers must be a list of integers, got {layers!r}"
        )
    if len(set(layers)) != len(layers):
        raise ManifestError(f"{source}: field hooks.layers repeats a layer: {layers!r}")
    pooling = value["pooling"]
    if pooling not in POOLINGS:
        raise ManifestError(
            f"{source}: field hooks.pooling is {pooling!r}; expected one of {POOLINGS}"
        )
    if "normalize" in value:
        normalize = value["normalize"]
        if not isinstance(normalize, bool):
            raise ManifestError(
                f"{source}: field hooks.normalize must be true or false, got {normalize!r}"
            )
    else:
        normalize = _model_normalizes(model_id)
    variant = value.get("variant", "float32")
    try:
        Variant.parse(variant if isinstance(variant, str) else repr(variant))
    except VariantError as exc:
        raise ManifestError(f"{source}: field hooks.variant: {exc}") from exc
    return HookSpec(layers=tuple(layers), pooling=pooling, normalize=normalize, variant=variant)


def _model_normalizes(model_id: str) -> bool:
    """The model folder's own choice (a Normalize module), where the folder is here; an engine
    for a model that is not here fails when it is created anyway."""
    from fabric_gpu.model import ModelNotFoundError, resolve_model_dir
    from fabric_gpu.model_defaults import model_defaults

    try:
        return model_defaults(resolve_model_dir(model_id)).normalize
    except ModelNotFoundError:
        return False


def manifest_for_model(
    model_id: str,
    *,
    backend: str,
    dtype: str,
    profile: ConsumerProfile,
    hooks: HookSpec,
) -> EngineManifest:
    """A manifest for a model on local disk, its weights hash read from the files."""
    from fabric_gpu.model import resolve_model_dir, weights_sha256

    return EngineManifest.from_mapping(
        {
            "model_id": model_id,
            "weights_sha256": weights_sha256(resolve_model_dir(model_id)),
            "backend": backend,
            "dtype": dtype,
            "max_batch_tokens": profile.max_batch_tokens,
            "max_batch_items": profile.max_batch_items,
            "max_seq_len": profile.max_seq_len,
            "seq_granularity": profile.seq_granularity,
            "hooks": hooks.to_mapping(),
        },
        source=f"manifest for {model_id}",
    )
