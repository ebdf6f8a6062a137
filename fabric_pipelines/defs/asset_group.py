"""What the asset families share: their group in the UI and their code versions (which the
index receipt records)."""

CODE_VERSION = "0.1.0"
# Each asset's code version; the index receipt records them all.
CODE_VERSIONS = {
    "tokenised_tasks": f"tokenise-{CODE_VERSION}",
    "shape_batches": f"plan-{CODE_VERSION}",
    "extraction_outputs": f"extract-{CODE_VERSION}",
    "vector_index": f"index-{CODE_VERSION}",
}
# One group for the four families: the UI opens a graph of several groups with each group
# collapsed, and a group of one asset then hides that asset's name.
PIPELINE_GROUP = "inference_fabric"
