"""The sweeps' launcher (`hydra/launcher: eaglet_local` in the sweep files): submitit's local launcher, which
also prints where each trial's output goes.

A trial runs in its own process (or one per device) whose stdout and stderr go to files, not to the
terminal: submitit's `<sweep dir>/.submitit/<job id>/<job id>_<task>_log.out` and `.err`. Each trial links
its own into its folder as `trial.out` and `trial.err` (eaglet.sweeps.launch.link_trial_logs); this launcher
prints those paths per trial as it starts. On SLURM, `hydra/launcher=submitit_slurm` replaces it.
Hydra loads launchers from the `hydra_plugins` package only, hence this module's place.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn
from hydra.types import HydraContext
from hydra_plugins.hydra_submitit_launcher import config, submitit_launcher
from omegaconf import DictConfig, open_dict

from eaglet.sweeps.launch import TRIAL_LOGS


def trial_folder(context: HydraContext, config: DictConfig, overrides: list[str], number: int) -> str:
    """The job's hydra.sweep.subdir (its swept values, ttt5-vocab8192), composed as the job will compose it."""
    job_config = context.config_loader.load_sweep_config(config, overrides)
    with open_dict(job_config.hydra.job):
        job_config.hydra.job.num = number
    return str(job_config.hydra.sweep.subdir)


class TrialLogsLocalLauncher(submitit_launcher.LocalLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None
        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        for number, overrides in enumerate(job_overrides, start=initial_job_idx):
            name = trial_folder(self.hydra_context, self.config, list(overrides), number)
            out, err = (sweep_dir / name / log for log in TRIAL_LOGS)
            print(
                f"sweep trial #{name} ({' '.join(overrides)}): output in {out}, errors in {err}", flush=True
            )
        return super().launch(job_overrides, initial_job_idx)


ConfigStore.instance().store(
    group="hydra/launcher",
    name="eaglet_local",
    node=config.LocalQueueConf(_target_=f"{__name__}.{TrialLogsLocalLauncher.__name__}"),
    provider="eaglet",
)
