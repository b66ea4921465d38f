"""Write a draft head as a serving-format folder, then re-read it and check it against the format's contract.

The head's tensors are checked by name and shape before anything is written; the written folder is checked
as a server would read it (`eaglet.formats.contract`). A folder that holds other files is refused unless
`overwrite` allows replacing config.json and model.safetensors there (other files are left).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from eaglet.config.schema import DraftConfig
from eaglet.errors import ConfigError, DataError, DiskFullError
from eaglet.formats.contract import check_eagle_folder, check_speculators_folder
from eaglet.formats.eagle import eagle_config, expected_shapes
from eaglet.formats.folder import CONFIG_FILE, WEIGHTS_FILE
from eaglet.formats.speculators import (
    VOCAB_BUFFERS,
    expected_speculators_shapes,
    speculators_config,
    speculators_name,
    uses_draft_vocab,
)
from eaglet.fsutil import atomic_output, human_bytes, is_disk_full
from eaglet.model.draft_head import Eagle3DraftHead


def refuse_non_empty(out_dir: Path, *, overwrite: bool) -> None:
    """Fail unless `out_dir` is absent, an empty folder, or `overwrite` allows replacing what is there."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"export folder {out_dir} is a file; choose a folder path")
    if overwrite or not out_dir.exists():
        return
    present = sorted(p.name for p in out_dir.iterdir())
    if present:
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        raise ConfigError(
            f"export folder {out_dir} is not empty ({shown}); choose an empty folder or pass export.overwrite=true "
            "to replace config.json and model.safetensors there"
        )


def contract_problems(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> list[str]:
    """Unexpected, missing and mis-shaped tensors of `state` against the expected names and shapes."""
    problems = [f"unexpected tensor {n}" for n in state if n not in expected]
    problems += [f"missing tensor {n}" for n in expected if n not in state]
    problems += [
        f"{n}: shape {tuple(state[n].shape)}, expected {shape}"
        for n, shape in expected.items()
        if n in state and tuple(state[n].shape) != shape
    ]
    return problems


def _write_folder(
    out_dir: Path,
    state: dict[str, torch.Tensor],
    expected: dict[str, tuple[int, ...]],
    config: dict[str, Any],
    *,
    contract: str,
    dtype: torch.dtype,
) -> None:
    """Weights (floating point ones cast to `dtype`) and config.json, each replaced atomically."""
    problems = contract_problems(state, expected)
    if problems:
        raise DataError(
            f"refusing to export a head that breaks the {contract} contract: {'; '.join(problems)}"
        )
    tensors = {n: (t.to(dtype) if t.is_floating_point() else t).contiguous() for n, t in state.items()}
    # In memory first: safetensors' own file writer reports a full disk as an opaque SafetensorError.
    weights = save(tensors, metadata={"format": "pt"})
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        # Both files are written whole before either replaces an earlier one.
        with (
            atomic_output(out_dir / CONFIG_FILE) as config_tmp,
            atomic_output(out_dir / WEIGHTS_FILE) as weights_tmp,
        ):
            weights_tmp.write_bytes(weights)
            config_tmp.write_bytes((json.dumps(config, indent=2) + "\n").encode())
    except (OSError, DiskFullError) as exc:  # the atomic writer reports a full disk as DiskFullError
        if not is_disk_full(exc):
            raise
        raise DiskFullError(
            f"no space left on the disk of {out_dir} while writing the head ({human_bytes(len(weights))}); "
            "nothing there was replaced. Free space on that disk, or export to another folder"
        ) from None


def export_eagle(
    head: Eagle3DraftHead,
    cfg: DraftConfig,
    out_dir: Path,
    *,
    aux_layer_ids: list[int],
    include_embed: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
) -> Path:
    """Write the head as an EAGLE-format folder (vLLM, SGLang) and check what was written."""
    refuse_non_empty(out_dir, overwrite=overwrite)
    state = {name: t.detach().cpu() for name, t in head.state_dict().items()}
    if not include_embed:
        state.pop("embed_tokens.weight", None)
    _write_folder(
        out_dir,
        state,
        expected_shapes(head, cfg, include_embed=include_embed),
        eagle_config(head, cfg, aux_layer_ids, dtype),
        contract="serving",
        dtype=dtype,
    )
    check_eagle_folder(out_dir)
    return out_dir


def _check_speculators_exportable(
    head: Eagle3DraftHead, cfg: DraftConfig, aux_layer_ids: list[int], ttt_steps: int
) -> None:
    if head.target_hidden_size != cfg.hidden_size:
        raise ConfigError(
            f"the target hidden size {head.target_hidden_size} differs from the draft's {cfg.hidden_size}; "
            "speculators' Eagle3DraftModel needs them equal (export the EAGLE format instead)"
        )
    if len(aux_layer_ids) != head.num_aux:
        raise ConfigError(
            f"aux_layer_ids has {len(aux_layer_ids)} ids {list(aux_layer_ids)}, the head fuses {head.num_aux} "
            "aux states; pass the ids the head was trained on (the shard manifest's aux_layer_ids)"
        )
    if ttt_steps < 1:
        raise ConfigError(f"ttt_steps (speculative tokens) must be >= 1, got {ttt_steps}")


def export_speculators(
    head: Eagle3DraftHead,
    cfg: DraftConfig,
    out_dir: Path,
    *,
    aux_layer_ids: list[int],
    target_architecture: str = "LlamaForCausalLM",
    ttt_steps: int,
    verifier_name_or_path: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
) -> Path:
    """Write the head as a speculators-format folder (vLLM) and check what was written.

    `verifier_name_or_path` (the target's hub id or folder) is what speculators' loader needs (see
    `eaglet.formats.speculators`); null is what speculators itself writes for a draft built without one.
    """
    _check_speculators_exportable(head, cfg, aux_layer_ids, ttt_steps)
    refuse_non_empty(out_dir, overwrite=overwrite)
    state = {speculators_name(name): t.detach().cpu() for name, t in head.state_dict().items()}
    if not uses_draft_vocab(head):
        for name in VOCAB_BUFFERS:
            state.pop(name, None)
    config = speculators_config(
        head,
        cfg,
        aux_layer_ids=aux_layer_ids,
        target_architecture=target_architecture,
        ttt_steps=ttt_steps,
        verifier_name_or_path=verifier_name_or_path,
        dtype=dtype,
    )
    _write_folder(
        out_dir, state, expected_speculators_shapes(head, cfg), config, contract="speculators", dtype=dtype
    )
    check_speculators_folder(out_dir)
    return out_dir
