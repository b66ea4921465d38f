"""Replace assistant turns by the target's own answers (the largest single lever on acceptance).

Turn by turn: for a multi-turn conversation, the answer to user turn r is generated from the
conversation so far, including the target's own earlier answers. `regenerate_conversations` is the one
entry and chooses the path: with `extract.regenerate.endpoint` set it asks an OpenAI-compatible server
(vLLM, SGLang; eaglet.data.regenerate_endpoint), otherwise it generates in-process with transformers
(eaglet.data.regenerate_in_process). Both append finished conversations to the same JSONL
(eaglet.data.regenerated) and fsync, so a killed run resumes without re-generating what is on disk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from eaglet.config.schema import RegenerateConfig
from eaglet.data.conversations import Conversation
from eaglet.data.regenerate_in_process import regenerate_in_process
from eaglet.data.regenerate_stats import RegenerateStats
from eaglet.data.regenerated import import_finished
from eaglet.errors import ConfigError


def regenerate_conversations(
    model: torch.nn.Module | None,
    tokenizer: Any,
    conversations: Sequence[Conversation],
    *,
    cfg: RegenerateConfig,
    out_path: Path,
    max_length: int,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> tuple[list[Conversation], RegenerateStats]:
    """Regenerated copies of `conversations` (same ids and order), resuming from `out_path`; sampled answers
    are seeded per turn from `seed` (the run's seed).

    With `cfg.endpoint` set the server answers (`model` is not used) and the records go to a file next to
    `out_path` keyed by the served model and the template arguments (thinking mode), which change every answer;
    `template_kwargs` go to the server's chat template (default: the thinking switch alone).
    """
    if cfg.endpoint is not None:
        # Imported here: the client library is only needed when an endpoint is configured.
        from eaglet.data.regenerate_endpoint import (
            endpoint_output_path,
            regenerate_via_endpoint,
            served_model,
        )

        served = served_model(cfg)
        path = endpoint_output_path(out_path, cfg, served, template_kwargs)
        print(f"regenerating through {cfg.endpoint} (model {served}, thinking {cfg.thinking}) -> {path}")
        _import_answers(cfg, path, conversations)
        return regenerate_via_endpoint(
            conversations,
            cfg=cfg,
            seed=seed,
            model=served,
            out_path=path,
            max_length=max_length,
            tokenizer=tokenizer,
            chat_template=chat_template,
            template_kwargs=template_kwargs,
        )
    if model is None:
        raise ConfigError(
            "in-process regeneration needs the target model; set extract.regenerate.endpoint to regenerate "
            "through a server instead"
        )
    if cfg.thinking:
        raise ConfigError(
            "extract.regenerate.thinking=true is passed to a server's chat template; for in-process "
            "regeneration set the template's own variable instead, e.g. model.chat_template_kwargs={thinking: true}"
            " (or set extract.regenerate.endpoint)"
        )
    _import_answers(cfg, out_path, conversations)
    return regenerate_in_process(
        model,
        tokenizer,
        conversations,
        cfg=cfg,
        seed=seed,
        out_path=out_path,
        max_length=max_length,
        chat_template=chat_template,
    )


def _import_answers(cfg: RegenerateConfig, out_path: Path, conversations: Sequence[Conversation]) -> None:
    if cfg.import_from is None:
        return
    copied = import_finished(Path(cfg.import_from), out_path, conversations)
    print(f"imported {copied} regenerated conversations from {cfg.import_from} into {out_path}")
