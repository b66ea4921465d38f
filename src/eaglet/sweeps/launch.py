"""Several processes per trial under submitit's local executor: its tasks become the DDP ranks.

A trial's process must never start DDP processes itself: Lightning would re-run the command line of the
submitit job. With `hydra.launcher.tasks_per_node=<devices>` submitit starts one process per device; here
they export torch.distributed's environment (MASTER_ADDR, RANK, LOCAL_RANK, WORLD_SIZE), which Lightning
reads as processes launched for it. Under SLURM, Lightning reads SLURM's variables itself.
"""

from __future__ import annotations

import os
from pathlib import Path

from eaglet.errors import ConfigError

# Where a trial's folder links its process's stdout and stderr (submitit writes them under .submitit/).
TRIAL_LOGS = ("trial.out", "trial.err")


def adopt_submitit_local_tasks() -> bool:
    """Export the distributed environment when this is one of several local submitit tasks; True if done."""
    if (
        os.environ.get("SUBMITIT_EXECUTOR") != "local"
        or int(os.environ.get("SUBMITIT_LOCAL_NTASKS", "1")) < 2
    ):
        return False
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from submitit.helpers import TorchDistributedEnvironment

    # Every task keeps all the job's GPUs visible: Lightning picks cuda:LOCAL_RANK among them.
    env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    os.environ.setdefault("NODE_RANK", "0")
    rank_zero_only.rank = env.rank  # read from the environment at import, before the export
    return True


def check_one_process_per_rank(world_size: int) -> None:
    """A multi-device trial needs its ranks started by the launcher: DDP started from inside a multirun job
    would re-run the job's command line in every child."""
    started = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
    if world_size > 1 and started != world_size:
        raise ConfigError(
            f"this trial trains on {world_size} devices but the launcher started {started} process(es) for it; "
            f"set hydra.launcher.tasks_per_node={world_size} (the sweep files default it to hardware.devices)"
        )


def link_trial_logs(run_dir: Path) -> None:
    """Link this submitit task's stdout and stderr files into the trial's folder (TRIAL_LOGS)."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return
    from submitit import JobEnvironment

    paths = JobEnvironment().paths
    for name, target in zip(TRIAL_LOGS, (paths.stdout, paths.stderr), strict=True):
        link = run_dir / name
        link.unlink(missing_ok=True)
        link.symlink_to(Path(target).resolve())
