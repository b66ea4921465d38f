"""The export stage: a finished run's head, re-written and checked in a serving format."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from eaglet.config.schema import EagletConfig
from eaglet.errors import ConfigError
from eaglet.evaluate.draft_loader import load_eagle_draft
from eaglet.evaluate.stage import resolve_run
from eaglet.export.speculators_format import export_speculators
from eaglet.export.validate import check_eagle_folder, check_speculators_folder, export_eagle_checked

FORMATS = ("eagle", "speculators")


def run_export(cfg: EagletConfig) -> Path:
    ex = cfg.export
    if ex.format not in FORMATS:
        raise ConfigError(f"export.format={ex.format!r}: choose one of {list(FORMATS)}")
    run = resolve_run(ex.run, Path(cfg.paths.output_dir))
    head, draft_cfg, aux_ids = load_eagle_draft(run / "draft")
    out_dir = Path(ex.out_dir) if ex.out_dir else run / f"export-{ex.format}"
    if ex.format == "eagle":
        export_eagle_checked(head, draft_cfg, out_dir, aux_layer_ids=aux_ids, overwrite=ex.overwrite)
        check_eagle_folder(out_dir)
        return out_dir
    composed = run / ".hydra" / "config.yaml"
    ttt_steps = OmegaConf.load(composed).trainer.ttt_steps if composed.is_file() else cfg.trainer.ttt_steps
    export_speculators(
        head,
        draft_cfg,
        out_dir,
        aux_layer_ids=aux_ids,
        ttt_steps=ttt_steps,
        verifier_name_or_path=ex.verifier_name_or_path or cfg.model.path,
        overwrite=ex.overwrite,
    )
    check_speculators_folder(out_dir)
    return out_dir
