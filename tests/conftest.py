"""Shared fixtures: config composition through Hydra's compose API, and a session-wide model cache."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import hydra
import pytest
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

import eaglet.config

os.environ["WANDB_MODE"] = "disabled"
REPO_ROOT = eaglet.config.REPO_ROOT


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One converted-model/tokenizer cache for the whole session (the GGUF tokenizer is slow to read)."""
    return Path(os.environ.get("EAGLET_TEST_CACHE") or tmp_path_factory.mktemp("model-cache"))


class FakeWandb:
    """wandb at its boundary: what a stage hands to wandb.init, run.summary and run.log."""

    def __init__(self) -> None:
        self.inits: list[dict] = []
        self.summary: dict = {}
        self.logged: dict = {}

    def init(self, **kwargs):
        from types import SimpleNamespace

        self.inits.append(kwargs)
        return SimpleNamespace(summary=self.summary, log=self.logged.update, finish=lambda exit_code=0: None)

    def Image(self, path: str) -> tuple:  # noqa: N802 (wandb's name)
        return ("image", path)

    def Table(self, columns: list, data: list) -> tuple:  # noqa: N802
        return ("table", columns, data)


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> FakeWandb:
    """wandb replaced at its boundary (offline mode), recording what a stage writes to it."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    return fake


def compose_config(cache: Path, *overrides: str) -> DictConfig:
    """The composed and checked config with the model cache at `cache`, exactly as the entry points see it: for
    fixtures wider than a test, which cannot take `compose`."""
    with hydra.initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
        cfg = hydra.compose("config", overrides=[f"paths.cache_dir={cache}", *overrides])
    GlobalHydra.instance().clear()
    eaglet.config.check_config(cfg)
    return cfg


@pytest.fixture
def compose(model_cache: Path) -> Iterator[Callable[..., DictConfig]]:
    """compose(*overrides) -> the composed and checked config, exactly as the entry points see it."""
    yield lambda *overrides: compose_config(model_cache, *overrides)
    GlobalHydra.instance().clear()
