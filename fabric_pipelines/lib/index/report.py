"""An index's receipt and quality as Markdown for the Dagster UI: the receipt's essentials, the
recall curve, cluster sizes and health."""

from __future__ import annotations

from typing import Any

from fabric_pipelines.lib.core.plots import chart_and_table


def recall_curve_chart(quality: dict[str, Any]) -> str:
    """recall@1/10/100 and recall@k per nprobe (IVF), as plots on a 0-1 scale beside tables."""
    curve = quality.get("nprobe_curve", {})
    at = {k: quality[f"recall_at_{k}"] for k in (1, 10, 100) if f"recall_at_{k}" in quality}
    parts = [
        chart_and_table(
            [f"recall@{k}" for k in at],
            list(at.values()),
            ("", "recall"),
            title="recall against exact search",
            fmt="{:.4f}",
            full=1.0,
        )
    ]
    if curve:
        parts.append(
            chart_and_table(
                [f"nprobe {n}" for n in curve],
                list(curve.values()),
                ("", f"recall@{quality['k']}"),
                title=f"recall@{quality['k']} per nprobe",
                fmt="{:.4f}",
                full=1.0,
            )
        )
    return "\n\n".join(parts)


def receipt_summary(receipt: dict[str, Any], receipt_sha: str) -> str:
    """The receipt's essentials as a Markdown table (hashes in full, in code spans so they wrap
    as a unit); the whole receipt is the file it names."""
    quality, index, model = receipt["quality"], receipt["index"], receipt["model"]
    rows = [
        ("receipt sha256", f"`{receipt_sha}`"),
        ("index sha256", f"`{receipt['index_sha256']}`"),
        ("vectors", f"{receipt['source']['rows']:,}"),
        ("task sets", f"{len(receipt['source']['task_sets']):,}"),
        ("model", f"{model.get('model_id', '')} (`{model['model_key']}`), dim {model['dim']}"),
        ("weights sha256", f"`{model.get('weights_sha256', '')}`"),
        ("index", f"{index['factory']}, {index['metric']}, {index['shards']} shards"),
        ("nprobe", str(index["params"].get("nprobe", 0))),
        (f"recall@{quality['k']}", f"{quality['recall_at_k']:.4f}"),
        ("built on", f"{receipt['build_device']} ({receipt['training'].get('builder', '')})"),
        ("inputs", f"{len(receipt['inputs'])} extraction run(s), linked below"),
    ]
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def cluster_sizes_chart(quality: dict[str, Any]) -> str:
    """Inverted lists per size range (IVF indexes), or a note where there are none."""
    ranges = quality.get("lists", {}).get("size_ranges")
    if not ranges:
        return "not an IVF index: no lists"
    return chart_and_table(
        [f"{r} vectors" for r in ranges],
        list(ranges.values()),
        ("list size", "lists"),
        title="inverted lists per size",
    )


def cluster_health_table(quality: dict[str, Any]) -> str:
    """The cluster-health summary and vector counts as a Markdown table."""
    rows = {
        **quality.get("cluster_health", {}),
        **{f"vectors_{k}": v for k, v in quality["vectors"].items()},
    }
    for key in ("lists", "knn_density_10", "near_duplicates"):
        if key in quality:
            value = quality[key]
            rows.update(
                {f"lists_{k}": v for k, v in value.items() if k != "size_ranges"}
                if isinstance(value, dict)
                else {key: value}
            )
    return "| measure | value |\n|---|---:|\n" + "\n".join(
        f"| {k} | {v} |" for k, v in rows.items()
    )
