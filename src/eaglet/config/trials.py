"""Names of the jobs of a multirun (sweep trials): the values of the swept settings, `ttt5-vocab8192`.

A job sees only its own overrides, the fixed ones and the swept ones alike. The swept keys are known where the
sweep starts: `SweepAxes` (a Hydra callback, conf/config.yaml) reads them there, from `hydra.sweeper.params`
and the command line's sweep overrides (`trainer.lr=1e-4,3e-4`, `choice(...)`), and hands them to the jobs
in the environment (submitit's local and SLURM jobs inherit it). Without it (compose API) the sweeper's
params are the axes.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

AXES_ENV = "EAGLET_SWEEP_AXES"
# Short labels of the usual axes; any other key is labelled by its last component (trainer.lr -> lr).
LABELS = {"trainer.ttt_steps": "ttt", "draft.vocab_size": "vocab"}
# Overrides that pick what to run, never an axis of it.
NOT_AXES = {"sweeps", "experiments"}


def sweep_axes(hydra_cfg: Any) -> list[str]:
    """The keys a sweep varies: `hydra.sweeper.params`, then the command line's sweep overrides."""
    params = OmegaConf.select(hydra_cfg, "sweeper.params", default=None) or {}
    axes = [str(key) for key in params]
    for override in _parse(list(hydra_cfg.overrides.task)):
        if override.is_sweep_override() and override.key_or_group not in axes:
            axes.append(override.key_or_group)
    return axes


def trial_name(hydra_cfg: Any) -> str:
    """This job's values of the swept keys, `ttt5-vocab8192`; the job number when nothing is swept."""
    axes = json.loads(os.environ[AXES_ENV]) if AXES_ENV in os.environ else sweep_axes(hydra_cfg)
    values = {o.key_or_group: o.get_value_element_as_str() for o in _parse(list(hydra_cfg.overrides.task))}
    if not axes:  # the sweep's own keys are unknown here: every override this job was given names it
        axes = [key for key in values if key not in NOT_AXES and not key.startswith("hydra")]
    parts = [_part(key, values[key]) for key in axes if key in values]
    return "-".join(parts) if parts else str(OmegaConf.select(hydra_cfg, "job.num", default=0))


def _part(key: str, value: str) -> str:
    label = LABELS.get(key, key.rsplit(".", 1)[-1].rsplit("/", 1)[-1])
    glue = "" if re.match(r"[-\d.]", value) else "_"
    return re.sub(r"[^\w.=+-]", "_", f"{label}{glue}{value}")


def _parse(overrides: list[str]) -> list[Any]:
    return OverridesParser.create().parse_overrides(overrides)


class SweepAxes(Callback):
    """At the start of a multirun: the swept keys, for every job's `trial_name` (see the module's docstring)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        os.environ[AXES_ENV] = json.dumps(sweep_axes(config.hydra))
