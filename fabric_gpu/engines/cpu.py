"""The CPU reference engine: the Hugging Face encoder in eager fp32.

Every faster backend is compared with this one. It reads its inputs on the CPU, so the runtime
gives it ordinary host memory. Its vectors do not depend on the batch under MKL's strict
reproducibility mode, which `fabric_gpu` turns on before the first product (MKL_CBWR).
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
from transformers import AutoModel

from fabric_gpu.engines.base import (
    EngineError,
    EngineOutput,
    InputLocation,
    PaddedBatch,
    check_batch,
    normalise_layers,
)
from fabric_gpu.engines.pooling import pool_padded, unit_length
from fabric_gpu.manifest import EngineManifest
from fabric_gpu.model import offline_environment, resolve_model_dir, weights_sha256
from fabric_gpu.profile import ConsumerProfile
from fabric_gpu.variants import Int8Calibration

log = logging.getLogger(__name__)


class CpuEngine:
    input_location = InputLocation.HOST

    def __init__(self, manifest: EngineManifest) -> None:
        if manifest.backend != "cpu":
            raise EngineError(
                f"CpuEngine needs backend 'cpu', the manifest says {manifest.backend!r}"
            )
        if manifest.dtype != "float32":
            raise EngineError(
                f"the CPU reference engine runs float32 only; the manifest says {manifest.dtype!r}"
            )
        offline_environment()
        if "STRICT" not in os.environ.get("MKL_CBWR", "").upper():
            log.warning(
                "MKL_CBWR=%s: without MKL's strict mode (AUTO,STRICT) the CPU engine's vectors "
                "may depend on the batch, and reuse would hand out other bytes than a recompute",
                os.environ.get("MKL_CBWR"),
            )
        model_dir = resolve_model_dir(manifest.model_id)
        manifest.verify_weights(weights_sha256(model_dir))
        self.manifest = manifest
        self.model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        config = self.model.config
        self.hidden_size = int(config.hidden_size)
        self.num_layers = int(config.num_hidden_layers)
        max_positions = int(
            getattr(config, "max_position_embeddings", manifest.profile.max_seq_len)
        )
        if manifest.profile.max_seq_len > max_positions:
            raise EngineError(
                f"max_seq_len {manifest.profile.max_seq_len} exceeds the model's "
                f"max_position_embeddings {max_positions}"
            )
        self.hook_indices = normalise_layers(manifest.hooks.layers, self.num_layers)
        manifest.hooks.output_variant().out_dims(self.hidden_size)  # dims within the model's
        self.int8_calibration: Int8Calibration | None = None

    def set_int8_calibration(self, calibration: Int8Calibration) -> None:
        """The runner quantises with it (the variant's CPU twin, on the emulated GPU)."""
        self.int8_calibration = calibration

    @property
    def profile(self) -> ConsumerProfile:
        return self.manifest.profile

    @torch.inference_mode()
    def forward_hidden(
        self, input_ids: np.ndarray, lengths: np.ndarray
    ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """Pooled embeddings [items, hidden] (float32) and each hook layer's hidden states for
        every position, padding included ([items, seq_len, hidden], float16)."""
        ids = torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64))
        lengths_t = torch.from_numpy(np.asarray(lengths, dtype=np.int64))
        seq_len = ids.shape[1]
        mask = torch.arange(seq_len)[None, :] < lengths_t[:, None]
        out = self.model(
            input_ids=ids,
            attention_mask=mask.to(torch.int64),
            token_type_ids=torch.zeros_like(ids),
            output_hidden_states=bool(self.hook_indices),
        )
        pooled = unit_length(
            pool_padded(out.last_hidden_state, mask, self.manifest.hooks.pooling),
            self.manifest.hooks.normalize,
        )
        hooks = {
            layer: out.hidden_states[index].to(torch.float16).numpy()
            for layer, index in zip(self.manifest.hooks.layers, self.hook_indices, strict=True)
        }
        return pooled.numpy(), hooks

    def forward(self, batch: PaddedBatch) -> EngineOutput:
        check_batch(self.profile, batch)
        pooled, padded = self.forward_hidden(batch.input_ids, batch.lengths)
        real = np.arange(batch.seq_len)[None, :] < batch.lengths[:, None]
        return EngineOutput(pooled=pooled, hooks={k: v[real] for k, v in padded.items()})

    def close(self) -> None:
        del self.model
