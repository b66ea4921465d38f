"""The export stage: a finished run's head, re-written and checked in a serving format."""

from __future__ import annotations

from pathlib import Path

from eaglet.config.schema import EagletConfig
from eaglet.errors import ConfigError
from eaglet.formats.reader import load_eagle_draft
from eaglet.formats.writer import export_eagle, export_speculators
from eaglet.run_dir import RunDir

FORMATS = ("eagle", "speculators")


def run_export(cfg: EagletConfig) -> Path:
    ex = cfg.export
    if ex.format not in FORMATS:
        raise ConfigError(f"export.format={ex.format!r}: choose one of {list(FORMATS)}")
    run = RunDir.resolve(ex.run, Path(cfg.paths.output_dir), key="export.run")
    head, draft_cfg, aux_ids = load_eagle_draft(run.draft_dir)
    out_dir = Path(ex.out_dir) if ex.out_dir else run.export_dir(ex.format)
    if ex.format == "eagle":
        return export_eagle(head, draft_cfg, out_dir, aux_layer_ids=aux_ids, overwrite=ex.overwrite)
    trained = run.settings()
    ttt_steps = trained.trainer.ttt_steps if trained is not None else cfg.trainer.ttt_steps
    return export_speculators(
        head,
        draft_cfg,
        out_dir,
        aux_layer_ids=aux_ids,
        ttt_steps=ttt_steps,
        verifier_name_or_path=ex.verifier_name_or_path or cfg.model.path,
        overwrite=ex.overwrite,
    )
