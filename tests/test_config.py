"""Every config file composes and validates; typos and wrong types fail naming the key."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from eaglet.config import CONF_DIR

GROUPS = {
    group: sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    for group in ("model", "dataset", "hardware", "trainer")
}
OPTIONS = [(group, name) for group, names in GROUPS.items() for name in names]


def test_every_group_has_options() -> None:
    assert {
        "smollm2_135m",
        "tiny_llama",
        "llama3_1_8b",
        "qwen3_8b",
        "deepseek_v3",
        "kimi_k2",
        "kimi_k2_5",
    } <= set(GROUPS["model"])
    assert {"cpu", "h200_x1", "h100_x8", "rtx_pro6000_x8", "b200_nvl8", "b300_nvl8", "slurm_h200_4x8"} <= set(
        GROUPS["hardware"]
    )
    assert {"default", "jsonl", "sharegpt", "gsm8k_train", "oasst_en100"} <= set(GROUPS["dataset"])


@pytest.mark.parametrize(("group", "name"), OPTIONS, ids=[f"{g}={n}" for g, n in OPTIONS])
def test_every_config_file_composes(compose, group: str, name: str) -> None:
    extra = ["dataset.paths=[/data/mine.jsonl]"] if (group, name) == ("dataset", "jsonl") else []
    cfg = compose(f"{group}={name}", *extra)
    # Resolves every interpolation; only user-supplied values (weights paths) may stay missing.
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    assert container[group]["name" if group != "trainer" else "ttt_steps"] is not None


def test_dataset_files_exist(compose) -> None:
    from pathlib import Path

    for name in GROUPS["dataset"]:
        if name == "jsonl":
            continue
        cfg = compose(f"dataset={name}")
        for path in cfg.dataset.paths:
            assert Path(path).is_file(), f"dataset={name}: {path} does not exist"


def test_issue_commands_compose(compose) -> None:
    cfg = compose("model=llama3_1_8b", "dataset=sharegpt", "hardware=h200_x1", "extract.batch_tokens=65536")
    assert cfg.extract.batch_tokens == 65536
    cfg = compose("model=kimi_k2_5", "extract.backend=vllm", "hardware=rtx_pro6000_x8")
    assert cfg.model.aux_layer_ids == [2, 30, 58]
    assert cfg.model.layer_path == "language_model.model.layers"
    assert cfg.hardware.interconnect == "pcie"
    assert cfg.model.trust_remote_code is False


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.hiden_size=3", "hiden_size"),
        ("extract.bach_tokens=3", "bach_tokens"),
        ("trainer.ttt_step=3", "ttt_step"),
        ("hardware.devics=2", "devics"),
    ],
)
def test_typo_in_an_override_names_the_key(compose, override: str, key: str) -> None:
    with pytest.raises(ConfigCompositionException) as exc:
        compose(override)
    assert key in str(exc.value) + str(exc.value.__cause__)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.hidden_size=abc", "hidden_size"),
        ("extract.overwrite=maybe", "overwrite"),
        ("trainer.lr=fast", "lr"),
    ],
)
def test_wrong_type_names_the_key(compose, override: str, key: str) -> None:
    with pytest.raises(ConfigCompositionException) as exc:
        compose(override)
    assert key in str(exc.value) + str(exc.value.__cause__)


def test_typo_in_a_config_file_is_an_error(tmp_path) -> None:
    """A group file with an unknown key fails validation against the schema."""
    import hydra
    from hydra.core.global_hydra import GlobalHydra

    (tmp_path / "model").mkdir()
    bad = (CONF_DIR / "model" / "tiny_llama.yaml").read_text().replace("num_layers:", "num_layer:")
    (tmp_path / "model" / "broken.yaml").write_text(bad)
    try:
        with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            with pytest.raises(ConfigCompositionException) as exc:
                hydra.compose("config", overrides=[f"hydra.searchpath=[file://{tmp_path}]", "model=broken"])
    finally:
        GlobalHydra.instance().clear()
    assert "num_layer" in str(exc.value) + str(exc.value.__cause__)


@pytest.mark.parametrize(
    ("model", "ids"), [("smollm2_135m", [2, 15, 27]), ("llama3_1_8b", [2, 16, 29]), ("kimi_k2", [2, 30, 58])]
)
def test_default_aux_layer_ids(compose, model: str, ids: list[int]) -> None:
    from eaglet.target_model import resolve_aux_layer_ids

    assert resolve_aux_layer_ids(compose(f"model={model}").model) == ids


def test_chat_template_variables_are_added_with_a_plus(compose) -> None:
    cfg = compose("model=kimi_k2_5", "+model.chat_template_kwargs.thinking=false")
    assert dict(cfg.model.chat_template_kwargs) == {"thinking": False}
    assert dict(compose().model.chat_template_kwargs) == {}
