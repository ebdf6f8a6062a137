"""One call from texts or token ids to vectors: `encode(inputs, manifest)`.

It is the path the pipeline's workers take, without a database in between: the model's tokenizer
(tokenise.py), the batch planner (batching.py) and the engine behind the runtime (runtime.py),
in the same order and with the same batches. For the same tokens and manifest it gives the
pipeline's vectors (bit for bit on the CPU engine), so scripts, benches and parity checks measure
the product's own path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from tqdm import tqdm

from fabric_gpu.batching import plan_batches, prefix_keys
from fabric_gpu.engines import create_engine, input_layout
from fabric_gpu.engines.base import Engine
from fabric_gpu.manifest import EngineManifest
from fabric_gpu.model import load_tokenizer, resolve_model_dir
from fabric_gpu.runtime import BatchResult, open_runner
from fabric_gpu.tokenise import encode_texts


class EncodeError(ValueError):
    """An input the engine cannot take, or a batch the engine failed; names the input or batch."""


@dataclass(frozen=True)
class Encoded:
    """What `encode` returns, in input order."""

    vectors: np.ndarray  # [inputs, hidden] float32 (or the manifest's output variant's rows)
    offsets: np.ndarray  # int64 [inputs + 1]: input i's tokens are tokens[offsets[i]:offsets[i+1]]
    tokens: np.ndarray  # int32: every input's token ids back to back (special tokens included)
    # Per hooked layer: [all tokens, hidden] back to back, laid out as `tokens`.
    hidden_states: dict[int, np.ndarray] = field(default_factory=dict)

    def hidden_state(self, layer: int, item: int) -> np.ndarray:
        """Hooked layer `layer`'s hidden states of input `item`: [its tokens, hidden]."""
        return self.hidden_states[layer][self.offsets[item] : self.offsets[item + 1]]


def encode(
    inputs: Sequence[str] | Sequence[Sequence[int]],
    manifest: EngineManifest,
    *,
    hooks: Sequence[int] | None = None,
    prompt: str = "",
    engine: Engine | None = None,
    progress: bool = False,
) -> Encoded:
    """Pooled vectors (and hooked layers' hidden states) of `inputs`: texts, which the model's
    tokenizer encodes with its special tokens, or lists of token ids taken as given.

    `hooks`: the layers whose hidden states to return, instead of the manifest's. `prompt`:
    text put before each text before tokenising (as a task set's prompt is). `engine`: a
    warm engine for the manifest to reuse (it stays open); by default one is created for the
    call and closed after it."""
    if hooks is not None:
        manifest = replace(manifest, hooks=replace(manifest.hooks, layers=tuple(hooks)))
    if engine is not None and engine.manifest != manifest:
        raise EncodeError("the engine given was made for another manifest (or other hooks)")
    tokens, offsets = _tokens(inputs, manifest, prompt)
    lengths = np.diff(offsets)
    _check_lengths(lengths, manifest.profile.max_seq_len)
    profile = manifest.profile.with_layout(input_layout(manifest))
    plan = plan_batches(lengths, profile, keys=prefix_keys(tokens, offsets))
    # Each shape the plan uses, with the most items any of its batches holds.
    shapes = sorted(
        (int(seq_len), int(plan.item_count[plan.seq_len == seq_len].max()))
        for seq_len in np.unique(plan.seq_len)
    )
    own_engine = engine is None
    engine = create_engine(manifest) if engine is None else engine
    vectors: np.ndarray | None = None
    hidden_states: dict[int, np.ndarray] = {}
    batch_rows: dict[int, np.ndarray] = {}
    bar = tqdm(total=len(lengths), desc="encode", unit="input", disable=not progress)

    def on_result(result: BatchResult) -> None:  # the runtime's drain thread, in batch order
        nonlocal vectors
        rows = batch_rows.pop(result.batch_id)
        if result.error:
            raise EncodeError(
                f"batch {result.batch_id} (inputs {rows.tolist()[:8]}…): {result.error}"
            )
        assert result.pooled is not None
        if vectors is None:
            # float32, or the manifest's output variant (float16, int8, packed bits)
            vectors = np.empty((len(lengths), result.pooled.shape[1]), result.pooled.dtype)
        vectors[rows] = result.pooled
        if result.hooks:
            # A batch's hidden states hold its inputs' tokens back to back, in batch order.
            where = _token_positions(offsets, rows)
            for layer, states in result.hooks.items():
                if layer not in hidden_states:
                    hidden_states[layer] = np.empty((len(tokens), states.shape[1]), states.dtype)
                hidden_states[layer][where] = states
        bar.update(rows.size)

    try:
        with open_runner(engine, tokens, offsets, on_result, shapes=shapes) as runner:
            for b in range(plan.n_batches):
                start, count = int(plan.item_start[b]), int(plan.item_count[b])
                rows = plan.order[start : start + count]
                batch_rows[b + 1] = rows
                runner.submit(b + 1, rows, int(plan.seq_len[b]))
            runner.finish()
    finally:
        bar.close()
        if own_engine:
            engine.close()
    if vectors is None:  # no inputs
        vectors = np.zeros((0, 0), np.float32)
    return Encoded(vectors, offsets, tokens, hidden_states)


def _tokens(
    inputs: Sequence[str] | Sequence[Sequence[int]], manifest: EngineManifest, prompt: str
) -> tuple[np.ndarray, np.ndarray]:
    """Every input's token ids back to back (int32), and where each starts."""
    if len(inputs) == 0:
        raise EncodeError("no inputs: pass at least one text or list of token ids")
    if all(isinstance(x, str) for x in inputs):
        tokenizer = load_tokenizer(resolve_model_dir(manifest.model_id), prompt)
        lengths, tokens, refused = encode_texts(tokenizer, list(inputs))
        if refused:
            i, reason = next(iter(sorted(refused.items())))
            raise EncodeError(f"input {i}: {reason}")
    elif prompt:
        raise EncodeError("a prompt goes before texts; token ids are taken as given")
    elif not any(isinstance(x, str) for x in inputs):
        arrays = [np.asarray(x) for x in inputs]
        for i, ids in enumerate(arrays):
            if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
                raise EncodeError(f"input {i}: token ids must be a flat list of integers")
        lengths = np.array([a.size for a in arrays], np.int64)
        tokens = np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, np.int32)
    else:
        raise EncodeError("inputs mix texts and token-id lists: pass one kind per call")
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return np.ascontiguousarray(tokens, np.int32), offsets


def _check_lengths(lengths: np.ndarray, max_seq_len: int) -> None:
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise EncodeError(f"input {int(empty[0])} has no tokens; every input needs at least one")
    over = np.flatnonzero(lengths > max_seq_len)
    if over.size:
        i = int(over[0])
        raise EncodeError(
            f"input {i} has {int(lengths[i])} tokens, more than the manifest's max_seq_len "
            f"{max_seq_len} ({over.size} input(s) in all); shorten it or raise max_seq_len"
        )


def _token_positions(offsets: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Positions in the back-to-back token array of `rows`' tokens, row after row."""
    starts = offsets[rows]
    counts = offsets[rows + 1] - starts
    firsts = np.cumsum(counts) - counts  # where each row begins in the batch's own order
    return np.repeat(starts - firsts, counts) + np.arange(int(counts.sum()))
