"""trainer.init_from: a run that starts from a trained head's folder instead of the target's rows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import compose_config
from safetensors.torch import load_file, save_file
from test_train import shards, train_overrides  # noqa: F401 (the module-scoped shards fixture)

from eaglet.errors import ConfigError, DataError
from eaglet.train.run import run_training

# Small enough that the run's own steps leave the head where it started (Adam's steps are ~lr each).
NO_STEP = ("trainer.lr=1e-30", "trainer.max_steps=1", "trainer.val_every_n_steps=1")


@pytest.fixture(scope="module")
def trained(shards: Path, tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:  # noqa: F811
    """The draft folder of a six-step run."""
    out = tmp_path_factory.mktemp("trained")
    run_training(compose_config(model_cache, *train_overrides(shards, out)), out / "run")
    return out / "run" / "draft"


def exported(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "draft" / "model.safetensors")


def test_a_run_starts_from_the_head_and_keeps_its_draft_vocab(
    compose,
    shards: Path,  # noqa: F811
    trained: Path,
    tmp_path: Path,
) -> None:
    # The head with another draft vocab than this data's token counts pick: the last draft id moved to the
    # highest target id outside the run's own draft vocab (draft ids stay sorted by target id, as exported).
    weights = load_file(trained / "model.safetensors")
    d2t, t2d = weights["d2t"].clone(), weights["t2d"].clone()
    unused = int((~t2d).nonzero()[-1])
    old = d2t.numel() - 1 + int(d2t[-1])
    assert unused > old
    d2t[-1] = unused - (d2t.numel() - 1)
    t2d[old], t2d[unused] = False, True
    moved = tmp_path / "moved"
    shutil.copytree(trained, moved)
    save_file({**weights, "d2t": d2t, "t2d": t2d}, moved / "model.safetensors")

    continued = run_training(compose(*train_overrides(shards, tmp_path, "trainer.init_from=" + str(moved), *NO_STEP)),
                             tmp_path / "continued")  # fmt: skip
    fresh = run_training(compose(*train_overrides(shards, tmp_path, *NO_STEP)), tmp_path / "fresh")
    got, want = exported(Path(continued.run_dir)), load_file(moved / "model.safetensors")
    assert torch.equal(got["d2t"], d2t) and torch.equal(got["t2d"], t2d)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name].float(), tensor.float(), rtol=0, atol=1e-6, msg=name)
    # Without it the run starts from the target's rows and its own draft vocab: the check above can fail.
    assert not torch.equal(exported(Path(fresh.run_dir))["d2t"], d2t)
    assert not torch.allclose(exported(Path(fresh.run_dir))["fc.weight"].float(), want["fc.weight"].float())
    # Started from a trained head, the run's first validation is the trained head's, better than the target's.
    assert continued.val_loss < fresh.val_loss


def test_a_head_of_other_settings_is_refused_with_what_differs(
    compose,
    shards: Path,  # noqa: F811
    trained: Path,
    tmp_path: Path,
) -> None:
    cfg = compose(*train_overrides(shards, tmp_path, f"trainer.init_from={trained}", "draft.vocab_size=128"))
    with pytest.raises(ConfigError, match=r"draft.vocab_size=128 here, 256 there") as err:
        run_training(cfg, tmp_path / "run")
    assert "trainer.init_from=null" in str(err.value)


def test_a_folder_without_a_head_is_refused_before_anything_loads(
    compose,
    shards: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({}))
    cfg = compose(*train_overrides(shards, tmp_path, f"trainer.init_from={empty}"))
    with pytest.raises(DataError, match=r"no model.safetensors there"):
        run_training(cfg, tmp_path / "run")
