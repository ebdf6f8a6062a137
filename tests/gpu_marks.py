"""The marks of a test module that needs the GPU through both the runtime and torch: `gpu`, and
a skip that says why where either cannot reach one."""

from __future__ import annotations

import pytest
import torch

from fabric_gpu import probe_gpu

STATUS = probe_gpu()
TORCH_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (STATUS.available and torch.cuda.is_available()),
        reason="no GPU: " + (STATUS.reason or "torch sees no CUDA device"),
    ),
]
