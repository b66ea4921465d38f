"""trainer.init_from: a new run starts from a trained head's weights instead of the target's rows.

More steps than one session allows, or more data than one run saw, come from training again from the head the
last run exported (its draft/ folder, or any EAGLE-format export). The head's vocab mapping comes with it: its
lm_head rows are those of its own draft ids, whatever this run's token counts would pick. The frozen embedding
stays the target's; the optimizer and the learning-rate schedule start afresh. A run that resumes from a checkpoint never reads the folder: the checkpoint
holds the head as it was when it stopped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eaglet.errors import ConfigError, DataError
from eaglet.formats.folder import CONFIG_FILE, WEIGHTS_FILE
from eaglet.formats.reader import load_eagle_draft
from eaglet.model.draft_head import Eagle3DraftHead


def check_init_from(folder: str | Path | None) -> None:
    """Before anything loads: trainer.init_from names a folder with a head's config and weights."""
    if folder is None:
        return
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (Path(folder) / name).is_file()]
    if missing:
        raise DataError(
            f"trainer.init_from={folder}: no {' or '.join(missing)} there; point it at a trained head's folder "
            "(a run's draft/, or the output of python export.py), or start from the target (trainer.init_from=null)"
        )


def start_from_head(
    head: Eagle3DraftHead, folder: str | Path, draft: Mapping[str, Any], aux_layer_ids: list[int]
) -> None:
    """Load the head exported in `folder` into `head` (this run's, built from the DraftConfig fields `draft`),
    after checking that it is the same shape of head, over the same target vocab and aux layers."""
    trained, trained_cfg, trained_aux = load_eagle_draft(folder, embed_tokens=head.embed_tokens.weight)
    ours = {**draft, "vocab_size": head.d2t.numel()}
    theirs = {**asdict(trained_cfg), "vocab_size": trained.d2t.numel()}
    problems = [f"draft.{k}={ours[k]} here, {theirs[k]} there" for k in ours if ours[k] != theirs[k]]
    if trained.t2d.numel() != head.t2d.numel():
        problems.append(f"a target vocab of {head.t2d.numel()} ids here, {trained.t2d.numel()} there")
    if list(trained_aux) != list(aux_layer_ids):
        problems.append(f"aux layers {list(aux_layer_ids)} here, {list(trained_aux)} there")
    if problems:
        raise ConfigError(
            f"trainer.init_from={folder}: that head is not one this run can continue ({'; '.join(problems)}). "
            "Train with the settings it was trained with (draft=..., draft.vocab_size=..., model.aux_layer_ids=...), "
            "or start from the target (trainer.init_from=null)"
        )
    state = trained.state_dict()
    with torch.no_grad():
        for name, tensor in head.state_dict().items():
            if name != "embed_tokens.weight":  # the frozen embedding stays this run's target's own
                tensor.copy_(state[name].to(tensor.dtype))
