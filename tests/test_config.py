"""Every config file composes and validates; typos, wrong types and wrong choices fail naming the key;
contradicting settings fail after composition; where runs read and write."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import hydra
import pytest
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from eaglet.config import CONF_DIR, REPO_ROOT, shared_data_dir

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


# ---- choices, checks after composition, the draft group, the project root ------------------------------


@pytest.mark.parametrize(
    ("override", "key", "allowed"),
    [
        ("trainer.attention=flexx", "trainer.attention", "[auto, flex, sdpa]"),
        ("export.format=onnx", "export.format", "[eagle, speculators]"),
        ("export.format=gguf", "export.format", "[eagle, speculators]"),
        ("sweep.tau_source=bogus", "sweep.tau_source", "[decode, sim]"),
        ("extract.backend=sglang", "extract.backend", "[transformers, vllm]"),
        ("hardware.interconnect=infiniband", "hardware.interconnect", "[none, pcie, nvlink]"),
        ("plan.dtypes=[int8]", "plan.dtypes", "[bfloat16, float16, float32]"),
    ],
)
def test_a_wrong_choice_fails_at_composition(compose, override: str, key: str, allowed: str) -> None:
    with pytest.raises(ConfigCompositionException) as exc:
        compose(override)
    message = str(exc.value) + str(exc.value.__cause__)
    assert key in message and f"expected one of {allowed}" in message


def test_a_wrong_choice_stops_the_entry_point_before_any_work() -> None:
    command = [sys.executable, str(REPO_ROOT / "train.py"), "trainer.attention=flexx", "--cfg", "job"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode != 0 and not proc.stdout
    assert "trainer.attention" in proc.stderr and "expected one of [auto, flex, sdpa]" in proc.stderr


def test_choices_are_plain_strings_wherever_the_config_is_recorded(compose) -> None:
    from eaglet.config.plain import plain_config

    cfg = compose("trainer.attention=flex", "export.format=speculators")
    assert cfg.trainer.attention == "flex" and f"{cfg.export.format}" == "speculators"
    recorded = plain_config(cfg)  # W&B's config, the JSON reports
    assert type(recorded["trainer"]["attention"]) is str and type(recorded["plan"]["dtypes"][0]) is str
    assert "attention: flex" in OmegaConf.to_yaml(cfg)  # .hydra/config.yaml


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.ttt_steps=0"], "trainer.ttt_steps must be >= 1"),
        (["trainer.val_fraction=1.0"], "trainer.val_fraction must be in [0, 1)"),
        (["trainer.online_overlap=true"], "needs trainer.features=online (got shards)"),
        (
            ["trainer.features=online", "trainer.online_overlap=true", "trainer.loader_threads=0"],
            "trainer.loader_threads >= 1 (got 0)",
        ),
        (
            ["trainer.online_compile=true"],
            "online_compile=true compiles the target that online training runs",
        ),
        (["hardware.devices=0"], "hardware.devices must be >= 1"),
        (["hardware.strategy=fsdp"], "hardware.strategy=fsdp needs GPUs"),
        (["hardware=h200_x2", "hardware.strategy=fsdp", "trainer.embed_dtype=bfloat16"], "embed_dtype"),
        (["draft.num_key_value_heads=2"], "draft.num_attention_heads=9 is not a multiple"),
        (
            ["draft=llama3_1_8b"],
            "draft.hidden_size=4096 must equal the target's hidden size model.hidden_size=576",
        ),
        (["draft.vocab_size=0"], "draft.vocab_size must be >= 1"),
        (["plan.compare=[cpu,cpu]"], "plan.compare lists ['cpu'] more than once"),
        (
            ["plan.calibration.training_microbatch_step_ms=-1"],
            "plan.calibration.training_microbatch_step_ms must be >= 0",
        ),
        (
            ["plan.calibration.training_efficiency=1.5"],
            "plan.calibration.training_efficiency must lie in (0, 1]",
        ),
    ],
)
def test_contradicting_settings_fail_after_composition_naming_the_key(
    compose, overrides: list[str], message: str
) -> None:
    from eaglet.config import check_config
    from eaglet.errors import ConfigError

    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra.compose("config", overrides=overrides)
    GlobalHydra.instance().clear()
    with pytest.raises(ConfigError) as exc:
        check_config(cfg)
    assert message in str(exc.value)
    with pytest.raises(ConfigError):  # the tests' compose checks as the entry points do
        compose(*overrides)


@pytest.mark.parametrize("model", GROUPS["model"])
def test_every_model_selects_its_draft_head(compose, model: str) -> None:
    cfg = compose(f"model={model}")  # checked: the draft's hidden size is the target's
    assert cfg.draft == compose(f"model={model}", f"draft={model}").draft


def test_draft_shape_and_vocab_follow_the_model_and_override_alone(compose) -> None:
    kimi = compose("model=kimi_k2_5").draft
    assert (kimi.hidden_size, kimi.num_attention_heads, kimi.num_key_value_heads, kimi.head_dim) == (
        7168,
        64,
        64,
        128,
    )
    assert (kimi.intermediate_size, kimi.rope_theta, kimi.vocab_size) == (18432, 50000.0, 32000)
    assert compose().draft.vocab_size == 1024  # the embedded smollm2_135m
    cfg = compose("model=kimi_k2_5", "draft.vocab_size=8192")
    assert cfg.draft.vocab_size == 8192 and cfg.draft.head_dim == 128


def test_a_model_of_your_own_without_a_draft_file_is_asked_for_one(tmp_path: Path) -> None:
    from eaglet.config import check_config
    from eaglet.errors import ConfigError

    (tmp_path / "model").mkdir()
    mine = (CONF_DIR / "model" / "tiny_llama.yaml").read_text().replace("name: tiny_llama", "name: mine")
    (tmp_path / "model" / "mine.yaml").write_text(mine)
    try:
        with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = hydra.compose("config", overrides=[f"hydra.searchpath=[file://{tmp_path}]", "model=mine"])
            check_config(
                hydra.compose(
                    "config",
                    overrides=[f"hydra.searchpath=[file://{tmp_path}]", "model=mine", "draft=tiny_llama"],
                )
            )
    finally:
        GlobalHydra.instance().clear()
    with pytest.raises(ConfigError, match=r"model=mine has no draft head .*add conf/draft/mine.yaml"):
        check_config(cfg)


def _clone(root: Path) -> Path:
    """A checkout without the package: an entry script; the code and its config groups are the shared ones."""
    root.mkdir()
    shutil.copy(REPO_ROOT / "plan.py", root)
    return root


def _plan(clone: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(clone / "plan.py"), "hardware=h200_x1", "plan.tokens=100000", *args]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=clone, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_two_clones_sharing_one_virtualenv_each_write_their_own_data_and_outputs(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLET_")}
    clones = [_clone(tmp_path / name) for name in ("first", "second")]
    before = set((REPO_ROOT / "outputs" / "plan").glob("*"))
    for clone in clones:
        paths = OmegaConf.create(_plan(clone, env, "--cfg", "job", "--resolve").stdout).paths
        assert (paths.data_dir, paths.output_dir) == (str(clone / "data"), str(clone / "outputs"))
        assert (paths.cache_dir, paths.shared_data) == (str(clone / ".cache"), str(shared_data_dir(clone)))
        _plan(clone, env)  # a run: Hydra writes its folder under the clone's outputs/
        assert len(list((clone / "outputs" / "plan").glob("*/.hydra/config.yaml"))) == 1
    assert set((REPO_ROOT / "outputs" / "plan").glob("*")) == before  # nothing went to the package's checkout
    # $EAGLET_ROOT wins over the working directory.
    shown = _plan(clones[0], {**env, "EAGLET_ROOT": str(clones[1])}, "--cfg", "job", "--resolve")
    paths = OmegaConf.create(shown.stdout).paths
    assert (paths.data_dir, paths.output_dir) == (str(clones[1] / "data"), str(clones[1] / "outputs"))


def _git_clone(source: Path, target: Path) -> Path:
    subprocess.run(["git", "init", "-q", str(source)], check=True)
    subprocess.run(["git", "clone", "-q", str(source), str(target)], check=True, capture_output=True)
    return target


def test_shared_data_is_found_beside_the_project_root_first(tmp_path: Path) -> None:
    for place in ("a/shared/data", "b/shared/data"):
        (tmp_path / place).mkdir(parents=True)
    (tmp_path / "a/project").mkdir()
    (tmp_path / "b/checkout").mkdir()
    found = shared_data_dir(tmp_path / "a/project", checkout=tmp_path / "b/checkout")
    assert found == tmp_path / "a/shared/data"
    # None beside the project root: the one beside the checkout the code runs from.
    (tmp_path / "c/project").mkdir(parents=True)
    assert (
        shared_data_dir(tmp_path / "c/project", checkout=tmp_path / "b/checkout")
        == tmp_path / "b/shared/data"
    )


def test_a_clone_made_elsewhere_finds_the_shared_data_beside_its_origin(tmp_path: Path) -> None:
    (tmp_path / "work/shared/data").mkdir(parents=True)
    clone = _git_clone(tmp_path / "work/main", tmp_path / "elsewhere/fresh")
    assert shared_data_dir(clone, checkout=clone) == tmp_path / "work/shared/data"


def test_without_shared_data_anywhere_the_path_beside_the_project_root_is_named(tmp_path: Path) -> None:
    clone = _git_clone(tmp_path / "work/main", tmp_path / "elsewhere/fresh")
    assert shared_data_dir(clone, checkout=clone) == tmp_path / "elsewhere/shared/data"
    # A remote origin is never taken for a folder.
    subprocess.run(["git", "-C", str(clone), "remote", "set-url", "origin", "git@host:work/main"], check=True)
    other = tmp_path / "other"
    shutil.copytree(clone, other)
    assert shared_data_dir(other, checkout=other) == tmp_path / "shared/data"
