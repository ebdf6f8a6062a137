"""What reuse by content (fabric_pipelines/lib/broker/reuse.py) saves and what it costs, end to end.

Four product runs (`fabric submit FILE --run`, each in its own process, submit to published
index), all on the same engine, SQLite:
  first       a corpus of N tasks in a fresh data root, reuse on: nothing to reuse yet; its
              planning stores N keys;
  second      the corpus with --edit of its tasks changed and --new added, reuse on, in that
              root: only those reach the engine (counted from the rows the engines returned);
  second_off  the same file with --no-reuse, in a copy of the root taken before `second`:
              everything computed again, and the same rows indexed as `second`'s;
  first_off   the first corpus with --no-reuse in another fresh root: the peer that prices the
              keys.
Printed: second / second_off (what an edit costs with reuse against without), first /
first_off (the keys' cost when nothing can be reused), the planning step's seconds of each, and
the engine's own row counts. Inputs are token ids as in bench/e2e.py, the model the yardstick's
random encoder with all-MiniLM's tokenizer.

    python bench/reuse.py                  # GPU: BERT-base, 500,000 tasks
    python bench/reuse.py --cpu            # CPU engine: 2,000 tasks

(At 1,000,000 tasks the four sets' 768-d rows, 3 GB each in one SQLite file, fill the GPU
machine's disk.)

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import CLS, SEP, run_product, stage_seconds
from yardstick import DEFAULT, load_reference, random_model


def write_sets(
    folder: Path, lengths: np.ndarray, edit: float, new: float
) -> tuple[Path, Path, int]:
    """The corpus and its edited copy (Parquet of id + token_ids): `edit` of the tasks get new
    token ids, `new` more tasks are appended. Also how many distinct token-id sequences the copy
    holds that the corpus does not: what its run must compute."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(7)

    def table(rows: list[np.ndarray], ids: list[str]) -> pa.Table:
        offsets = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum([len(r) for r in rows], out=offsets[1:])
        values = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(rows)))
        return pa.table({"id": pa.array(ids, pa.string()), "token_ids": values})

    def task(length: int) -> np.ndarray:
        ids = rng.integers(1000, 30000, int(length), dtype=np.int32)
        ids[0], ids[-1] = CLS, SEP
        return ids

    corpus = [task(n) for n in lengths]
    ids = [f"t{i}" for i in range(len(corpus))]
    first = folder / "first.parquet"
    pq.write_table(table(corpus, ids), first)
    edited = corpus.copy()
    for i in rng.choice(len(corpus), round(edit * len(corpus)), replace=False):
        edited[i] = task(len(corpus[i]))
    added = [task(n) for n in rng.choice(lengths, round(new * len(corpus)))]
    second = folder / "second.parquet"
    pq.write_table(table(edited + added, ids + [f"n{i}" for i in range(len(added))]), second)
    unseen = {r.tobytes() for r in edited + added} - {r.tobytes() for r in corpus}
    return first, second, len(unseen)


def summary(run: dict[str, Any]) -> dict[str, Any]:
    extraction = run["report"]["extract"].get("extraction_outputs", {})
    index = run["report"]["index"].get("vector_index", {})
    stages = stage_seconds(run["report"])
    return {
        "wall_seconds": round(run["wall_seconds"], 2),
        "plan_seconds": stages["plan"],
        "extraction_seconds": stages["extraction"],
        "index_seconds": stages["index"],
        # Where the index step's time went, and whether it took the vectors (and the index made
        # ready) from the extraction (lib/index/vector_tail.py, prebuild.py) or read the table.
        "index_phases": {k[6:]: v for k, v in stages.items() if k.startswith("index_")},
        "vectors_followed": index.get("vectors_followed"),
        "index_prebuilt": bool(index.get("prebuilt_seconds")),
        "engine_items": extraction.get("engine_items"),
        "completed": run["completed"],
        "reused": run["reused"],
        "exactly_once": run["exactly_once"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU engine on a small corpus")
    parser.add_argument("--model", help="yardstick size (default bert_base; --cpu minilm_l6)")
    parser.add_argument("--tasks", type=int, help="corpus size (default 500,000; --cpu 2,000)")
    parser.add_argument("--edit", type=float, default=0.10, help="share of tasks edited")
    parser.add_argument("--new", type=float, default=0.05, help="share of tasks added")
    parser.add_argument("--reference", default=str(DEFAULT))
    parser.add_argument("--tokenizer", help="folder with all-MiniLM's tokenizer files")
    parser.add_argument("--workdir", help="keep inputs and the data root here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from fabric_gpu.manifest import HookSpec, manifest_for_model
    from fabric_gpu.model import DEFAULT_MODEL_ID, resolve_model_dir
    from fabric_gpu.profile import ConsumerProfile

    n = args.tasks or (2000 if args.cpu else 500_000)
    size = args.model or ("minilm_l6" if args.cpu else "bert_base")
    reference = load_reference(args.reference)
    tokenizer_from = Path(args.tokenizer) if args.tokenizer else resolve_model_dir(DEFAULT_MODEL_ID)
    profile = (
        ConsumerProfile(8192, 256, 512, 8) if args.cpu else ConsumerProfile(32768, 1024, 512, 8)
    )
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fabric-reuse-"))
    work.mkdir(parents=True, exist_ok=True)
    lengths = np.asarray(reference.reference_lengths(n, max_len=512, seed=1))
    first, second, edited = write_sets(work, lengths, args.edit, args.new)
    dtype = torch.float32 if args.cpu else torch.float16
    model = random_model(reference, work / f"model-{size}", size, tokenizer_from, dtype)
    manifest = manifest_for_model(
        str(model), backend="cpu" if args.cpu else "torch",
        dtype="float32" if args.cpu else "float16", profile=profile, hooks=HookSpec((), "mean"),
    )  # fmt: skip
    manifest_file = work / f"engine-{size}.json"
    manifest_file.write_text(json.dumps(manifest.to_mapping()))
    root = work / "root"
    runs: dict[str, dict[str, Any]] = {}

    def run(name: str, home: Path, source: Path, extra: tuple[str, ...] = ()) -> None:
        url = f"sqlite:///{home}/fabric.db"
        runs[name] = summary(run_product(home, source, manifest_file, url, 1, name, extra))
        print(f"{name}: {runs[name]}", flush=True)

    run("first", root, first)
    # The edited set runs with reuse and without, each in its own copy of the data root holding
    # the first corpus alone: both then index the same rows (the model's index covers every set).
    twin = work / "root-no-reuse"
    shutil.copytree(root, twin)
    run("second", root, second)
    run("second_off", twin, second, ("--no-reuse",))
    # The keys' cost on a fresh corpus: the first corpus without reuse, in an empty data root.
    run("first_off", work / "root-fresh", first, ("--no-reuse",))
    result = {
        "model": size,
        "tasks": n,
        "edited_and_new": edited,  # distinct token-id sequences the corpus did not hold
        "runs": runs,
        "edit_vs_full_recompute": round(
            runs["second"]["wall_seconds"] / runs["second_off"]["wall_seconds"], 3
        ),
        "keys_cost_fresh_corpus": round(
            runs["first"]["wall_seconds"] / runs["first_off"]["wall_seconds"], 3
        ),
        "plan_seconds_with_keys_vs_without": round(
            runs["first"]["plan_seconds"] / max(runs["first_off"]["plan_seconds"], 1e-9), 3
        ),
        "engine_computed_only_the_edits": runs["second"]["engine_items"] == edited,
    }
    print(
        f"{size}, {n:,} tasks: after editing {args.edit:.0%} and adding {args.new:.0%}, the rerun "
        f"took {runs['second']['wall_seconds']:.1f} s with reuse and "
        f"{runs['second_off']['wall_seconds']:.1f} s without ({result['edit_vs_full_recompute']}x; "
        f"engine rows {runs['second']['engine_items']:,} of {edited:,} edited and new); a fresh "
        f"corpus {runs['first']['wall_seconds']:.1f} s with keys vs "
        f"{runs['first_off']['wall_seconds']:.1f} s without ({result['keys_cost_fresh_corpus']}x; "
        f"planning {runs['first']['plan_seconds']:.2f} s vs {runs['first_off']['plan_seconds']:.2f} s)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
