"""Run tracking: W&B online only with wandb's own credentials for its server, WANDB_MODE respected, a folder's
W&B run recorded and reused, the composed config logged."""

from __future__ import annotations

from pathlib import Path

import pytest

from eaglet.tracking import forget_record, read_record, record_for, wandb_mode
from eaglet.train import tracking

KEY = "0123456789abcdef0123456789abcdef01234567"  # the format of a W&B API key


@pytest.fixture
def wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """No credentials anywhere; set(...) changes the environment and makes wandb read it again."""
    import wandb

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # no settings file of the user's
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))

    def set_(**env: str) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        wandb.teardown()  # wandb reads its environment once per process

    set_()
    yield set_
    wandb.teardown()


def netrc(tmp_path: Path, host: str) -> None:
    (tmp_path / "netrc").write_text(f"machine {host}\n  login user\n  password {KEY}\n")
    (tmp_path / "netrc").chmod(0o600)


def test_online_only_with_credentials_for_wandbs_own_server(wandb_env, tmp_path: Path) -> None:
    assert wandb_mode() == "offline"  # no credentials: offline, no network call
    netrc(tmp_path, "api.wandb.ai")
    assert wandb_mode() is None  # logged in to the default server: online
    # A self-hosted server: the default server's entry is not a login there (a string search said it was).
    wandb_env(WANDB_BASE_URL="https://wandb.example.com")
    assert wandb_mode() == "offline"
    netrc(tmp_path, "wandb.example.com")
    assert wandb_mode() is None
    (tmp_path / "netrc").unlink()
    wandb_env(WANDB_API_KEY=KEY)
    assert wandb_mode() is None
    wandb_env(WANDB_MODE="disabled")  # the user's choice wins
    assert wandb_mode() == "disabled"


def test_a_folder_keeps_its_wandb_run(tmp_path: Path) -> None:
    first = record_for(tmp_path, project="p", group=None, name="run")
    again = record_for(tmp_path, project="other", group="g", name="else")
    # The recorded run is kept (id, project, name); a group it lacked is filled in.
    assert (again.id, again.project, again.name, again.group) == (first.id, "p", "run", "g")
    assert read_record(tmp_path) == again
    forget_record(tmp_path)
    assert read_record(tmp_path) is None and record_for(tmp_path, project="p").id != first.id


def test_the_wandb_logger_follows_the_mode_and_names_the_run_after_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert tracking.wandb_logger(save_dir=str(tmp_path), project="p") is None
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = tracking.wandb_logger(save_dir=str(tmp_path), project="p", tags=["t"], job_type="train")
    init = logger._wandb_init  # what wandb.init will be called with (lazily, on rank 0)
    assert init["mode"] == "offline" and init["resume"] == "allow" and init["name"] == tmp_path.name
    assert init["id"] == read_record(tmp_path).id and init["group"] is None and init["tags"] == ["t"]


@pytest.mark.e2e
def test_an_offline_run_is_written_and_finished(
    compose, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eaglet.train.extensions import build_extensions

    monkeypatch.setenv("WANDB_MODE", "offline")
    extensions = build_extensions(compose("wandb.tags=[test]"), tmp_path, resumed=False)
    csv, wandb_logger = extensions.loggers
    assert isinstance(csv, tracking.RunCSVLogger)
    assert wandb_logger.experiment.config["model"]["name"] == "smollm2_135m"  # the composed config, plain
    wandb_logger.log_metrics({"train/loss": 1.0}, step=0)
    tracking.finish_wandb(failed=False)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert (
        len(runs) == 1 and list(runs[0].glob("*.wandb")) and runs[0].name.endswith(read_record(tmp_path).id)
    )
    import wandb

    assert wandb.run is None
