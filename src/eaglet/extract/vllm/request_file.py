"""vLLM's per-request hidden-state files, and their conversion into eaglet sequences.

ExampleHiddenStatesConnector writes one safetensors file per finished request, at the path it returns in
the request's `kv_transfer_params["hidden_states_path"]` (by default `<shared_storage_path>/<req_id>.safetensors`):
  token_ids      int64 [T]                 the prompt's token ids
  hidden_states  model dtype [T, n_ids, H] one state per configured layer id, ascending layer order
The write happens in a background thread while the writer holds an exclusive flock on `<path>.lock`;
a reader takes a shared flock on it first, so it never sees a half-written file.
"""

from __future__ import annotations

import fcntl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from eaglet.data.templating import TokenizedConversation
from eaglet.errors import DataError
from eaglet.extract.vllm.layers import LayerLayout
from eaglet.shards import SequenceFeatures

PATH_KEY = "hidden_states_path"
TOKEN_IDS = "token_ids"
HIDDEN_STATES = "hidden_states"
LOCK_SUFFIX = ".lock"


class AlignmentError(DataError):
    """vLLM's token ids for a sequence differ from eaglet's, so eaglet's loss mask does not apply to them."""


@dataclass
class RequestFile:
    token_ids: torch.Tensor  # [T] integer
    hidden_states: torch.Tensor  # [T, n_ids, H]


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + LOCK_SUFFIX)


def read_request_file(path: str | Path) -> RequestFile:
    """Load one file, waiting on its lock while the connector is still writing it.

    The connector returns the path before the file exists (its lock is taken first), so the lock decides.
    """
    path = Path(path)
    lock = lock_path(path)
    try:
        if lock.exists():
            with open(lock) as handle:
                fcntl.flock(handle, fcntl.LOCK_SH)  # returns once the writer has released its exclusive lock
                return _load(path)
        return _load(path)
    except (SafetensorError, OSError) as err:
        raise DataError(
            f"{path}: not a readable safetensors file ({err}); the vLLM writer may have died"
        ) from None


def _load(path: Path) -> RequestFile:
    if not path.is_file():
        raise DataError(
            f"vLLM reported hidden states at {path}, but no such file is visible here; the server and eaglet must "
            "share that folder (extract.vllm.storage_dir, the server's shared_storage_path)"
        )
    return _validated(load_file(path), path)


def _validated(tensors: dict[str, torch.Tensor], path: Path) -> RequestFile:
    missing = {TOKEN_IDS, HIDDEN_STATES} - set(tensors)
    if missing:
        raise DataError(
            f"{path}: has tensors {sorted(tensors)}, missing {sorted(missing)}; it was not written by vLLM's "
            "ExampleHiddenStatesConnector"
        )
    ids, hidden = tensors[TOKEN_IDS], tensors[HIDDEN_STATES]
    if ids.ndim != 1 or ids.dtype.is_floating_point or hidden.ndim != 3 or not hidden.dtype.is_floating_point:
        raise DataError(
            f"{path}: token_ids {ids.dtype} {list(ids.shape)} and hidden_states {hidden.dtype} "
            f"{list(hidden.shape)}; expected integer [T] and float [T, n_ids, H]"
        )
    if hidden.shape[0] != ids.shape[0]:
        raise DataError(
            f"{path}: {hidden.shape[0]} hidden states for {ids.shape[0]} tokens; start vLLM without prefix caching "
            "and chunked prefill (the command eaglet prints does)"
        )
    return RequestFile(token_ids=ids, hidden_states=hidden)


def remove_request_file(path: str | Path) -> None:
    path = Path(path)
    path.unlink(missing_ok=True)
    lock_path(path).unlink(missing_ok=True)


def first_difference(ours: Sequence[int] | np.ndarray, theirs: Sequence[int] | np.ndarray) -> int | None:
    """Index of the first position where the two id sequences differ (a length difference counts); None if equal."""
    ours, theirs = np.asarray(ours, dtype=np.int64), np.asarray(theirs, dtype=np.int64)
    common = min(ours.size, theirs.size)
    diff = np.flatnonzero(ours[:common] != theirs[:common])
    if diff.size:
        return int(diff[0])
    return None if ours.size == theirs.size else common


def tokenization_mismatch(sample: TokenizedConversation, vllm_ids: Sequence[int]) -> str | None:
    """Why vLLM's tokenization of the rendered conversation disagrees with eaglet's, or None when it agrees.

    eaglet keeps the head of long conversations, so only vLLM's first `num_tokens` ids are compared.
    """
    theirs = list(vllm_ids)
    if sample.truncated:
        theirs = theirs[: sample.num_tokens]
    at = first_difference(sample.input_ids, theirs)
    if at is None:
        return None
    return _describe(at, sample.input_ids, theirs, "eaglet", "vLLM")


def to_sequence_features(
    sample_id: int, sample: TokenizedConversation, request: RequestFile, layout: LayerLayout, where: str
) -> SequenceFeatures:
    """One eaglet sequence from vLLM's file for it: ids checked against the ones sent, layers mapped."""
    at = first_difference(sample.input_ids, request.token_ids.numpy())
    if at is not None:
        raise AlignmentError(
            f"{where}: vLLM computed hidden states for other token ids than eaglet sent "
            f"({_describe(at, sample.input_ids, request.token_ids.tolist(), 'sent', 'vLLM')}); check that the server "
            "runs without prefix caching and with max_model_len > extract.max_length"
        )
    aux, last = layout.split(request.hidden_states, where)
    return SequenceFeatures(
        sample_id=sample_id,
        input_ids=torch.from_numpy(sample.input_ids),
        loss_mask=torch.from_numpy(sample.loss_mask),
        aux_hidden_states=aux,
        last_hidden_state=last,
    )


def _describe(at: int, ours: Sequence[int], theirs: Sequence[int], our_name: str, their_name: str) -> str:
    mine = int(ours[at]) if at < len(ours) else "end"
    other = int(theirs[at]) if at < len(theirs) else "end"
    return (
        f"first difference at token {at}: {our_name} {mine}, {their_name} {other}; "
        f"{len(ours)} vs {len(theirs)} tokens"
    )
