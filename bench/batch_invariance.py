"""Are an engine's vectors the same bytes whatever batch they ride in? (What reuse rests on.)

For random token-id sequences of mixed length, each one's pooled vector is computed:
  - alone: a batch of its own;
  - sorted: in batches of neighbouring lengths (the planner's buckets), the last one a tail;
  - shuffled: in batches of a random order, next to every other length, at other rows;
  - again: the shuffled batches once more (run-to-run determinism);
and compared byte for byte with `alone`. The CPU engine computes a padded batch at its bucket's
length (`ConsumerProfile.bucket_length`); the torch engine (GPU, fp16) a packed batch at its
token capacity, its mean pooling summing each item's tokens in a fixed order
(`fused.segment_mean`). The torch engine is measured four ways in one run: with each batch at its
own capacity or every batch at the profile's full capacity (one GEMM shape for all), and with the
ordered pooling or the atomics of `index_add_` it replaced; the JSON says what each costs.

    python bench/batch_invariance.py --backend torch --model bert_base        # a GPU
    python bench/batch_invariance.py --backend cpu --model minilm_l6 --texts 100

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch
from yardstick import DEFAULT, load_reference

from fabric_gpu.engines.base import PaddedBatch
from fabric_gpu.manifest import EngineManifest, HookSpec
from fabric_gpu.profile import ConsumerProfile


def manifest(backend: str, model: str, profile: ConsumerProfile) -> EngineManifest:
    return EngineManifest.from_mapping(
        {
            "model_id": f"random:{model}", "weights_sha256": "0" * 64, "backend": backend,
            "dtype": "float16" if backend == "torch" else "float32",
            "max_batch_tokens": profile.max_batch_tokens,
            "max_batch_items": profile.max_batch_items, "max_seq_len": profile.max_seq_len,
            "seq_granularity": profile.seq_granularity,
            "hooks": HookSpec((), "mean", normalize=True).to_mapping(),
        }
    )  # fmt: skip


def make_engine(backend: str, model_name: str, profile: ConsumerProfile, reference: Any) -> Any:
    if backend == "torch":
        from fabric_gpu.engines.torch_engine import TorchEngine

        return TorchEngine(
            manifest("torch", model_name, profile), model=reference.random_encoder(model_name)
        )
    from fabric_gpu.engines.cpu import CpuEngine

    engine = CpuEngine.__new__(CpuEngine)  # the CPU engine on the random encoder, in fp32
    engine.manifest = manifest("cpu", model_name, profile)
    engine.model = reference.random_encoder(model_name, device="cpu", dtype=torch.float32).eval()
    engine.hidden_size = int(engine.model.config.hidden_size)
    engine.num_layers = int(engine.model.config.num_hidden_layers)
    engine.hook_indices = ()
    engine.int8_calibration = None
    return engine


def forward(engine: Any, rows: list[np.ndarray], width: int) -> list[bytes]:
    ids = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    batch = PaddedBatch(ids, np.asarray([len(r) for r in rows], dtype=np.int64))
    pooled = engine.forward(batch).pooled
    return [np.ascontiguousarray(v, dtype="<f4").tobytes() for v in pooled]


def atomic_mean(x: torch.Tensor, cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """Mean pooling as it was: `index_add_`, whose CUDA atomics add in no fixed order."""
    lengths = (cu_seqlens[1 : rows + 1] - cu_seqlens[:rows]).long()
    seq_ids = torch.repeat_interleave(torch.arange(rows, device=x.device), lengths)
    sums = torch.zeros((rows, x.shape[1]), dtype=torch.float32, device=x.device)
    sums.index_add_(0, seq_ids, x[: seq_ids.shape[0]].float())
    return sums / lengths.clamp(min=1).to(torch.float32)[:, None]


def measure(
    engine: Any, rows: list[np.ndarray], profile: ConsumerProfile, layout: str, on_gpu: bool
) -> dict[str, Any]:
    """Each sequence alone, then sorted, shuffled and shuffled again; bytes compared."""
    width = profile.bucket_length

    def batches(order: list[int]) -> list[list[int]]:
        """Consecutive runs of `order` that fit the profile: padded, items x the longest bucket;
        packed, the tokens themselves (capacity rounding leaves a granule of room)."""
        out: list[list[int]] = []
        current: list[int] = []
        for i in order:
            grown = [*current, i]
            if layout == "padded":
                tokens = len(grown) * max(width(len(rows[j])) for j in grown)
            else:
                tokens = sum(len(rows[j]) for j in grown) + 128
            if current and (
                len(grown) > profile.max_batch_items or tokens > profile.max_batch_tokens
            ):
                out.append(current)
                grown = [i]
            current = grown
        return [*out, current]

    def run(groups: list[list[int]]) -> tuple[dict[int, bytes], float]:
        got: dict[int, bytes] = {}
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for group in groups:
            w = max(width(len(rows[i])) for i in group)
            got.update(zip(group, forward(engine, [rows[i] for i in group], w), strict=True))
        if on_gpu:
            torch.cuda.synchronize()
        return got, time.perf_counter() - start

    alone, _ = run([[i] for i in range(len(rows))])
    sorted_order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    shuffled_order = list(np.random.default_rng(40).permutation(len(rows)))
    run(batches(sorted_order))  # warm-up of every shape
    results: dict[str, Any] = {}
    runs: dict[str, dict[int, bytes]] = {}
    for way, order in (
        ("sorted", sorted_order),
        ("shuffled", shuffled_order),
        ("again", shuffled_order),
    ):
        got, seconds = run(batches(order))
        runs[way] = got
        same = sum(got[i] == alone[i] for i in got)
        worst = max(
            float(np.abs(np.frombuffer(got[i], "<f4") - np.frombuffer(alone[i], "<f4")).max())
            for i in got
        )
        results[way] = {"same_bytes": same, "of": len(got), "max_abs_diff": worst,
                        "seconds": round(seconds, 4)}  # fmt: skip
        print(f"  {way:9s} {same}/{len(got)} the same bytes as alone; max |diff| {worst:.3g}; "
              f"{seconds:.3f} s", flush=True)  # fmt: skip
    # Run to run: the same batches twice.
    results["again_as_shuffled"] = sum(
        runs["again"][i] == runs["shuffled"][i] for i in runs["again"]
    )
    print(
        f"  again     {results['again_as_shuffled']}/{len(rows)} the same bytes as the first time"
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("torch", "cpu"), default="torch")
    parser.add_argument("--model", default="bert_base", help="a yardstick size")
    parser.add_argument("--texts", type=int, default=400)
    parser.add_argument("--reference", default=str(DEFAULT))
    args = parser.parse_args()
    reference = load_reference(args.reference)
    on_gpu = args.backend == "torch"
    layout = "packed" if on_gpu else "padded"
    profile = ConsumerProfile(16384, 128, 512, 8, layout=layout)
    engine = make_engine(args.backend, args.model, profile, reference)
    rng = np.random.default_rng(39)
    lengths = rng.choice([3, 9, 17, 33, 60, 120, 250, 511], size=args.texts)
    lengths = np.maximum(2, lengths - rng.integers(0, 3, size=args.texts))
    rows = [np.concatenate([[101], rng.integers(1000, 30000, n - 2), [102]]) for n in lengths]
    results: dict[str, Any] = {
        "backend": args.backend, "model": args.model, "texts": len(rows),
        "device": torch.cuda.get_device_name() if on_gpu else "cpu", "ways": {},
    }  # fmt: skip
    ways = [("as built", False, False)]
    if on_gpu:
        ways += [("full capacity", True, False), ("atomic pooling", False, True),
                 ("full capacity, atomic pooling", True, True)]  # fmt: skip
    import fabric_gpu.engines.pooling as pooling
    import fabric_gpu.engines.torch_engine as torch_engine

    natural_capacity, ordered_mean = torch_engine.packed_capacity, pooling.segment_mean
    for name, full, atomic in ways:
        print(f"{name}:", flush=True)
        torch_engine.packed_capacity = (  # type: ignore[assignment]
            (lambda tokens: profile.max_batch_tokens) if full else natural_capacity
        )
        pooling.segment_mean = atomic_mean if atomic else ordered_mean  # type: ignore[assignment]
        results["ways"][name] = measure(engine, rows, profile, layout, on_gpu)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
