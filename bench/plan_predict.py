"""How well `fabric plan` predicts an extraction before it runs, on the product's own path.

In one fresh data root, as a user would:
  1. a first, smaller task set runs (`fabric submit small.parquet --run`): its extraction
     records the engine's measured speed (table engine_speeds);
  2. `fabric plan big.parquet --json` reads and plans the big set without running anything and
     predicts its engine time from that record;
  3. the big set runs (`fabric submit big.parquet --run`); its extraction step's wall time and
     its engine's pulling window are read from the run's report.
The ratio predicted / measured is printed for both: the issue's target is within 15 % of the
extraction step. Both sets have the yardstick's `reference_lengths()` (token ids, different
seeds); the model is the yardstick's random encoder with all-MiniLM's tokenizer, as in
bench/e2e.py.

    python bench/plan_predict.py                     # GPU: BERT-base, 100 k then 1 M tasks
    python bench/plan_predict.py --cpu               # CPU engine: 300 then 3,000 tasks

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import run_product, stage_seconds, write_token_ids
from yardstick import DEFAULT, load_reference, random_model


def fabric_plan(root: Path, tasks_file: Path, manifest_file: Path, db_url: str) -> dict[str, Any]:
    """`fabric plan FILE --json` in the run's data root, as its own process."""
    env = {**os.environ, "FABRIC_HOME": str(root), "DAGSTER_HOME": str(root)}
    env["FABRIC_DATABASE_URL"] = db_url
    command = [
        sys.executable, "-c", "from fabric_pipelines.cli import run_command; run_command()",
        "plan", str(tasks_file), "--manifest", str(manifest_file), "--json",
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"fabric plan failed (exit {done.returncode}): {done.stderr[-2000:]}")
    plan: dict[str, Any] = json.loads(done.stdout[done.stdout.index("{") :])
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU engine on small sets")
    parser.add_argument("--model", help="yardstick size (default bert_base; --cpu minilm_l6)")
    parser.add_argument("--tasks", type=int, help="the predicted set (default 1,000,000)")
    parser.add_argument("--first", type=int, help="the measuring set (default a tenth)")
    parser.add_argument("--reference", default=str(DEFAULT))
    parser.add_argument("--tokenizer", help="folder with all-MiniLM's tokenizer files")
    parser.add_argument("--workdir", help="keep inputs and the data root here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from fabric_gpu.manifest import HookSpec, manifest_for_model
    from fabric_gpu.model import DEFAULT_MODEL_ID, resolve_model_dir
    from fabric_gpu.profile import ConsumerProfile

    big = args.tasks or (3000 if args.cpu else 1_000_000)
    small = args.first or max(1, big // 10)
    size = args.model or ("minilm_l6" if args.cpu else "bert_base")
    reference = load_reference(args.reference)
    tokenizer_from = Path(args.tokenizer) if args.tokenizer else resolve_model_dir(DEFAULT_MODEL_ID)
    profile = (
        ConsumerProfile(8192, 256, 512, 8) if args.cpu else ConsumerProfile(32768, 1024, 512, 8)
    )
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fabric-plan-predict-"))
    work.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, n, seed in (("first", small, 1), ("big", big, 2)):
        files[name] = work / f"{name}-{n}.parquet"
        if not files[name].is_file():
            lengths = np.asarray(reference.reference_lengths(n, max_len=512, seed=seed))
            write_token_ids(files[name], lengths, seed=seed)
    dtype = torch.float32 if args.cpu else torch.float16
    model = random_model(reference, work / f"model-{size}", size, tokenizer_from, dtype)
    manifest = manifest_for_model(
        str(model), backend="cpu" if args.cpu else "torch",
        dtype="float32" if args.cpu else "float16", profile=profile, hooks=HookSpec((), "mean"),
    )  # fmt: skip
    manifest_file = work / f"engine-{size}.json"
    manifest_file.write_text(json.dumps(manifest.to_mapping()))
    root = work / "root"
    db_url = f"sqlite:///{root}/fabric.db"

    first = run_product(root, files["first"], manifest_file, db_url, 1, task_set="first")
    plan = fabric_plan(root, files["big"], manifest_file, db_url)
    measured = run_product(root, files["big"], manifest_file, db_url, 1, task_set="big")
    stages = stage_seconds(measured["report"])
    predicted = plan.get("predicted_seconds")
    result: dict[str, Any] = {
        "model": size,
        "first_tasks": small,
        "tasks": big,
        "padded_tokens": plan.get("padded_tokens"),
        "predicted_seconds": predicted,
        "prediction_source": (plan.get("measured") or {}).get("source"),
        "measured_extraction_seconds": stages["extraction"],
        "measured_pulling_seconds": stages["extraction_pulling"],
        "first_run_exactly_once": first["exactly_once"],
        "exactly_once": measured["exactly_once"],
    }
    if predicted is None:
        print(f"fabric plan made no prediction: {plan}")
    else:
        result["predicted_vs_extraction"] = round(predicted / stages["extraction"], 3)
        result["predicted_vs_pulling"] = round(predicted / stages["extraction_pulling"], 3)
        print(
            f"{size}: fabric plan predicted {predicted:.2f} s for {big:,} tasks (from the "
            f"{small:,}-task run's speed); the run's extraction step took "
            f"{stages['extraction']:.2f} s ({result['predicted_vs_extraction']:.3f}x; target "
            f"within 15%), its engine's pulling window {stages['extraction_pulling']:.2f} s "
            f"({result['predicted_vs_pulling']:.3f}x); exactly once: {measured['exactly_once']}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
