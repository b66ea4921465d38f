"""The extraction stage: the composed config in, the backend extract.backend names run, the summary out."""

from __future__ import annotations

from pathlib import Path

from eaglet.config.choices import ExtractFeatures
from eaglet.config.eval_sets import eval_set_defs
from eaglet.config.schema import EagletConfig
from eaglet.errors import ConfigError
from eaglet.extract.core import ExtractSummary
from eaglet.extract.job import ExtractionJob
from eaglet.extract.tokens import run_token_extraction
from eaglet.extract.transformers_backend import run_transformers_extraction
from eaglet.extract.vllm.run import run_vllm_extraction
from eaglet.shards import STORED_DTYPES

BACKENDS = ("transformers", "vllm")


def extraction_job(cfg: EagletConfig) -> ExtractionJob:
    """The stage's slice of the composed config."""
    return ExtractionJob(
        model=cfg.model,
        dataset=cfg.dataset,
        extract=cfg.extract,
        data_dir=Path(cfg.paths.data_dir),
        cache_dir=Path(cfg.paths.cache_dir),
        held_out_sets=eval_set_defs(cfg.eval),
        seed=cfg.seed,
    )


def run_extraction(cfg: EagletConfig) -> ExtractSummary:
    """Run the whole stage for a composed config and return what was written."""
    ext = cfg.extract
    if ext.backend not in BACKENDS:
        raise ConfigError(f"extract.backend={ext.backend!r}: choose transformers or vllm")
    if ext.dtype not in STORED_DTYPES:
        raise ConfigError(f"extract.dtype={ext.dtype!r}: choose one of {sorted(STORED_DTYPES)}")
    job = extraction_job(cfg)
    if ext.features == ExtractFeatures.tokens:  # checked after composition: the transformers backend
        return run_token_extraction(job)
    if ext.backend == "vllm":
        return run_vllm_extraction(job, cfg.hardware, seed=cfg.seed)
    return run_transformers_extraction(job)
