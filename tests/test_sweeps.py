"""Sweeps: τ at every draft length by replay (checked against real speculative decoding), the simulated curve,
the summary (table, heatmap, recommendation, vLLM line), and both sweep files end to end on the embedded default."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from eaglet.evaluate import Eagle3Proposer, NgramProposer, TargetState, greedy_decode, speculative_decode
from eaglet.model.draft_head import Eagle3DraftHead
from eaglet.plan.configs import load_draft
from eaglet.sweeps.collect import load_trials
from eaglet.sweeps.decode import replayed_curve
from eaglet.sweeps.replay import replay, replay_all, trace_prompt
from eaglet.sweeps.report import build_rows
from eaglet.sweeps.serving import Deployment, predicted_speedups, resolve_deployment, speculative_config
from eaglet.sweeps.simulated import tau_curve
from eaglet.sweeps.summarize import HEATMAP_FILE, SUMMARY_FILE, summarize
from eaglet.sweeps.summarize import main as summarize_main
from eaglet.target_model import load_target, resolve_aux_layer_ids

VOCAB = 49152  # conf/model/tiny_llama.yaml
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def tiny(model_cache: Path):
    import hydra
    from hydra.core.global_hydra import GlobalHydra

    import eaglet.config

    with hydra.initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
        cfg = hydra.compose("config", overrides=["model=tiny_llama"])
    GlobalHydra.instance().clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only spin-waits on a shared 2-core machine
    yield cfg.model, load_target(cfg.model, device="cpu", cache_dir=model_cache)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def eagle_head(tiny) -> Eagle3DraftHead:
    cfg, loaded = tiny
    torch.manual_seed(0)
    head = Eagle3DraftHead(
        load_draft(cfg.name),
        target_hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        draft_vocab_size=cfg.vocab_size,
    )
    d2t, t2d = torch.zeros(cfg.vocab_size, dtype=torch.int64), torch.ones(cfg.vocab_size, dtype=torch.bool)
    head.init_from_target(
        loaded.parts.embed_tokens.weight, loaded.parts.lm_head.weight, d2t, t2d, lm_head_trainable=False
    )
    return head.eval()


class NoisyOracle:
    """Proposes the target's greedy continuation, wrong at fixed output positions: how many tokens a step
    accepts depends on where it starts, so every draft length takes its own path through the output."""

    aux_layer_ids = None

    def __init__(self, prompt: list[int], continuation: list[int], wrong: set[int]) -> None:
        self.prompt, self.continuation, self.wrong = prompt, continuation, wrong
        self.done = 0

    def reset(self, tokens: list[int], state: TargetState) -> None:
        self.done = len(tokens) - len(self.prompt)

    def accept(self, tokens: list[int], state: TargetState) -> None:
        self.done += len(tokens)

    def propose(self, k: int) -> list[int]:
        guess = self.continuation[self.done : self.done + k]
        return [(t + 1) % VOCAB if self.done + i in self.wrong else t for i, t in enumerate(guess)]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (1, 9, 20)]
    return [*prompts, prompts[1] * 3]  # repeats give n-gram lookup matches


def _proposers(tiny, eagle_head, prompt: list[int]) -> dict:
    cfg, target = tiny
    continuation, _ = greedy_decode(target, prompt, NEW_TOKENS + 10)
    return {
        "oracle": lambda: NoisyOracle(prompt, continuation, wrong={3, 4, 9, 14, 15, 16}),
        "ngram": lambda: NgramProposer(min_n=1, max_n=3),
        "eagle3": lambda: Eagle3Proposer(eagle_head, resolve_aux_layer_ids(cfg)),
    }


def test_replay_equals_speculative_decoding_at_every_draft_length(tiny, eagle_head) -> None:
    _, target = tiny
    k_max = 4
    checked_accepts = 0
    for index, prompt in enumerate(_prompts()[1:]):
        reference, _ = greedy_decode(target, prompt, NEW_TOKENS)
        # A stop token met mid-output (every other prompt): the block that reaches it is cut.
        stop_ids = {reference[12]} if index % 2 else set()
        for name, make in _proposers(tiny, eagle_head, prompt).items():
            trace = trace_prompt(
                target, make(), prompt, k_max=k_max, max_new_tokens=NEW_TOKENS, stop_ids=stop_ids
            )
            for k in range(1, k_max + 1):
                output, real = speculative_decode(
                    target, make(), prompt, num_spec_tokens=k, max_new_tokens=NEW_TOKENS, stop_ids=stop_ids
                )
                replayed = replay(trace, k, NEW_TOKENS)
                assert output == trace.reference[: trace.length], (name, k)
                for field in ("steps", "accepted", "proposed", "new_tokens", "target_forwards"):
                    assert getattr(replayed, field) == getattr(real, field), (name, k, field)
                assert replayed.per_position_accepted == real.per_position_accepted, (name, k)
                assert replayed.per_position_proposed == real.per_position_proposed, (name, k)
                checked_accepts += real.accepted
    assert checked_accepts > 30  # the oracle and n-gram lookup accept blocks of several tokens


def test_replay_all_sums_prompts_and_tau_grows_with_the_draft_length(tiny, eagle_head) -> None:
    _, target = tiny
    traces = []
    for prompt in _prompts():
        oracle = _proposers(tiny, eagle_head, prompt)["oracle"]()
        traces.append(trace_prompt(target, oracle, prompt, k_max=4, max_new_tokens=NEW_TOKENS))
    totals = replay_all(traces, 4, NEW_TOKENS)
    assert [len(t.per_position_proposed) for t in totals] == [1, 2, 3, 4]
    for k, total in enumerate(totals, start=1):
        assert total.steps == sum(replay(t, k, NEW_TOKENS).steps for t in traces)
        assert 1.0 <= total.tau <= k + 1
    # The oracle is right at most positions: longer drafts accept more per step.
    assert totals[0].tau < totals[1].tau < totals[3].tau


def test_replayed_curve_ends_at_real_decoding_of_the_longest_draft_length(tiny, capsys) -> None:
    _, target = tiny
    curve = replayed_curve(
        target,
        NgramProposer(min_n=1, max_n=3),
        _prompts()[1:],
        k_max=3,
        max_new_tokens=NEW_TOKENS,
        tie_tolerance=0.0,
        stop_ids=(),
    )
    assert len(curve["tau"]) == 3 and [len(rates) for rates in curve["acceptance_rates"]] == [1, 2, 3]
    measured = curve["measured_at_max_draft_length"]
    assert curve["tau"][-1] == pytest.approx(measured["tau"]) and measured["near_ties"] == 0
    assert curve["new_tokens"] == 3 * NEW_TOKENS and measured["tau"] > 1.0
    assert "3/3" in capsys.readouterr().err  # progress per prompt
    # Each prompt's counts per draft length: they sum to the curve's τ, which lies in its interval.
    curves = zip(curve["per_prompt"], curve["tau"], curve["tau_ci95"], strict=True)
    for k, (counts, tau, (low, high)) in enumerate(curves, start=1):
        assert len(counts["accepted"]) == len(counts["steps"]) == 3
        assert 1 + sum(counts["accepted"]) / sum(counts["steps"]) == pytest.approx(tau), k
        assert low <= tau <= high


class _Rendered(Exception):
    pass


@pytest.mark.parametrize(
    ("overrides", "variables"),
    [
        (["+model.chat_template_kwargs.thinking=false"], {"thinking": False}),
        (
            ["extract.regenerate.endpoint=http://127.0.0.1:9/v1", "extract.regenerate.thinking=true"],
            {"thinking": True, "enable_thinking": True},
        ),
    ],
)
def test_decoded_prompts_are_rendered_with_the_template_variables(
    compose, monkeypatch, tmp_path: Path, overrides: list[str], variables: dict
) -> None:
    """Issue 22: the sweep's decoding rendered its prompts without them, unlike evaluation and extraction."""
    import eaglet.sweeps.decode as decode

    seen = []

    def resolve(tokenizer, override, passed=None):
        seen.append(passed)
        raise _Rendered

    monkeypatch.setattr(decode, "resolve_chat_template", resolve)
    with pytest.raises(_Rendered):
        decode.decode_curve(compose("model=tiny_llama", *overrides), tmp_path, 2)
    assert seen == [variables]


def test_tau_curve_is_the_simulated_tau_at_each_length() -> None:
    assert tau_curve([0.5, 0.5, 0.0]) == [1.5, 1.75, 1.75]
    assert tau_curve([1.0, 1.0]) == [2.0, 3.0]
    assert tau_curve([]) == []


# ---------------------------------------------------------------- a failing trial, the summary


def test_a_failing_trial_is_recorded_and_returns_nan(compose, tmp_path: Path, monkeypatch) -> None:
    import eaglet.sweeps.trial as trial

    finished = []

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB")

    monkeypatch.setattr(trial, "run_training", out_of_memory)
    monkeypatch.setattr(trial, "finish_wandb", lambda failed: finished.append(failed))
    cfg = compose("sweep.enabled=true", "draft.vocab_size=32000")
    value = trial.run_trial(cfg, tmp_path / "7")
    record = json.loads((tmp_path / "7" / trial.TRIAL_FILE).read_text())
    assert value is None and finished == [True]  # optuna's sweeper counts a non-number as a failed trial
    assert record["status"] == "failed" and record["draft_vocab_size"] == 32000
    assert record["error"].startswith("OutOfMemoryError: CUDA out of memory")
    (row,) = build_rows(load_trials(tmp_path), resolve_deployment(cfg.model, cfg.draft, cfg.hardware))
    assert row.status == "failed" and row.tau == [] and "OutOfMemoryError" in row.error


def test_measurements_go_to_the_trials_wandb_summary(monkeypatch) -> None:
    import sys
    from types import SimpleNamespace

    from eaglet.sweeps.trial import _log_to_wandb

    run = SimpleNamespace(summary={})
    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(run=run))
    result = {
        "objective_value": 1.2,
        "best_draft_length": 2,
        "best_speedup": 1.2,
        "tau": [1.5, 1.8],
        "speedup": [1.1, 1.2],
    }
    _log_to_wandb(result)
    assert run.summary == {
        "sweep/objective": 1.2, "sweep/best_draft_length": 2, "sweep/best_speedup": 1.2,
        "sweep/tau_1": 1.5, "sweep/speedup_1": 1.1, "sweep/tau_2": 1.8, "sweep/speedup_2": 1.2,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ("sweep.max_draft_length=0", "max_draft_length"),
        ("hardware.devices=2", "hydra.launcher.tasks_per_node=2"),  # DDP ranks come from the launcher
    ],
)
def test_bad_sweep_settings_fail_the_trial_before_training(compose, tmp_path: Path, setting, match) -> None:
    from eaglet.sweeps.trial import TRIAL_FILE, run_trial

    assert run_trial(compose("sweep.enabled=true", setting), tmp_path) is None
    record = json.loads((tmp_path / TRIAL_FILE).read_text())
    assert record["status"] == "failed" and match in record["error"] and record["seconds"] < 5


def _argmax(records: dict[int, dict]) -> tuple[float, int, int]:
    """(speedup, trial, draft length) of the highest predicted speedup; ties go to the earlier trial and length."""
    candidates = [
        (s, n, k) for n in sorted(records) for k, s in enumerate(records[n].get("speedup", []), start=1)
    ]
    top = max(c[0] for c in candidates)
    return next(c for c in candidates if c[0] == top)


def _prompt_counts(tau: float, spread: float, seed: int) -> dict[str, list[int]]:
    """Twenty prompts of 50 steps whose total gives `tau`, each prompt up to `spread` accepted tokens a step
    above or below (drawn per trial: heads differ in which prompts they find easy)."""
    accepted = round((tau - 1) * 1000)
    rng = random.Random(seed)
    counts = [accepted // 20 + round(rng.uniform(-spread, spread) * 50) for _ in range(20)]
    counts[0] += accepted - sum(counts)
    return {"accepted": counts, "steps": [50] * 20}


def _fake_sweep(root: Path, deployment: Deployment, spread: float | None = None) -> dict[int, dict]:
    """Trial folders as a sweep leaves them: three finished, one failed, one that died without a record. With
    `spread`, the finished trials decoded twenty prompts in process and kept each prompt's counts."""
    curves = {
        0: (1, 1024, [1.40, 1.55, 1.60]),
        1: (3, 1024, [1.50, 1.90, 2.15]),
        2: (3, 4096, [1.55, 1.97, 2.20]),
    }
    written = {}
    for number, (ttt, vocab, tau) in curves.items():
        data = {
            "status": "ok", "trial": number, "ttt_steps": ttt, "draft_vocab_size": vocab, "vocab_coverage": 0.9,
            "tau": tau, "speedup": predicted_speedups(deployment, vocab, tau), "serve": deployment.to_dict(),
            "draft_dir": str(root / str(number) / "draft"),
        }  # fmt: skip
        if spread is not None:
            data["decode"] = {"per_prompt": [_prompt_counts(t, spread, seed=number) for t in tau]}
        written[number] = data
    written[3] = {"status": "failed", "trial": 3, "ttt_steps": 1, "draft_vocab_size": 4096,
                  "error": "OutOfMemoryError: CUDA out of memory"}  # fmt: skip
    for number, data in written.items():
        (root / str(number)).mkdir(parents=True)
        (root / str(number) / "sweep_trial.json").write_text(json.dumps(data))
    (root / "4" / ".hydra").mkdir(parents=True)
    return written


def test_summary_table_heatmap_and_recommendation(tmp_path: Path, capsys) -> None:
    from eaglet.plan.configs import load_hardware, load_model

    deployment = Deployment(load_model("llama3_1_8b"), load_draft("llama3_1_8b"), load_hardware("h200_x1"))
    written = _fake_sweep(tmp_path, deployment)
    assert summarize_main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / SUMMARY_FILE).read_text())
    rows = {row["trial"]: row for row in summary["rows"]}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    for number, data in written.items():
        assert rows[number]["status"] == data["status"]
        assert rows[number]["tau"] == data.get("tau", [])
        assert rows[number]["speedup"] == data.get("speedup", [])
    assert rows[3]["error"].startswith("OutOfMemoryError") and rows[4]["status"] == "missing"
    # The recommendation is the argmax of the predicted speedup over every finished trial and draft length.
    best = _argmax(written)
    rec = summary["recommendation"]
    assert (rec["speedup"], rec["trial"], rec["draft_length"]) == best
    spec = json.dumps(
        {"method": "eagle3", "model": written[best[1]]["draft_dir"], "num_speculative_tokens": best[2]}
    )
    assert rec["vllm"] == f"vllm serve TARGET --speculative-config '{spec}'"
    assert rec["vllm"] in printed and "OutOfMemoryError" in printed and "2.200" in printed
    # τ from validation or a server: no per-prompt counts, so no resampled measure of the pick.
    assert rec["best_share"] is None and rec["rivals"] == [] and "resamples" not in printed
    png = tmp_path / HEATMAP_FILE
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("spread", "sure"), [(0.0, True), (0.6, False)])
def test_the_recommendation_says_how_often_it_stays_best_over_resampled_prompts(
    tmp_path: Path, capsys, spread: float, sure: bool
) -> None:
    """Trials 1 and 2 differ by 0.05 of τ: alike prompts make trial 2 best in every resample; prompts that
    differ as much as real ones do leave the two apart in no way the summary can tell, and it says so."""
    from eaglet.plan.configs import load_hardware, load_model

    deployment = Deployment(load_model("llama3_1_8b"), load_draft("llama3_1_8b"), load_hardware("h200_x1"))
    written = _fake_sweep(tmp_path, deployment, spread=spread)
    assert summarize_main([str(tmp_path)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    rec = json.loads((tmp_path / SUMMARY_FILE).read_text())["recommendation"]
    assert (rec["speedup"], rec["trial"], rec["draft_length"]) == _argmax(written)
    rivals = {(r["trial"], r["draft_length"]): r["share"] for r in rec["rivals"]}
    assert rec["best_share"] + sum(rivals.values()) == pytest.approx(1.0)
    if sure:
        assert rec["best_share"] == 1.0 and not rivals
        assert "best in 100% of resamples of the evaluation prompts" in printed
        assert "cannot be told apart" not in printed
    else:
        assert 0.3 < rec["best_share"] < 0.95 and rivals[(1, 3)] > 0.05
        assert "they cannot be told apart" in printed and "trial 1 at 3 draft tokens in" in printed


def test_the_summary_goes_to_the_sweeps_wandb_run(tmp_path: Path, fake_wandb) -> None:
    from eaglet.plan.configs import load_hardware, load_model
    from eaglet.tracking import read_record

    deployment = Deployment(load_model("llama3_1_8b"), load_draft("llama3_1_8b"), load_hardware("h200_x1"))
    written = _fake_sweep(tmp_path, deployment)
    fake = fake_wandb
    result = summarize(tmp_path)
    (init,) = fake.inits
    # Its own run in the trials' group (the sweep folder's name), recorded in the sweep folder.
    assert (
        init["group"] == tmp_path.name and init["job_type"] == "sweep-summary" and init["mode"] == "offline"
    )
    assert init["id"] == read_record(tmp_path).id and init["resume"] == "allow"
    rec = result.recommendation
    assert fake.summary["sweep/best_speedup"] == rec.speedup and fake.summary["sweep/best_trial"] == "2"
    assert fake.summary["sweep/finished"] == 3 and fake.summary["sweep/trials"] == len(written) + 1
    assert fake.logged["sweep/heatmap"] == ("image", str(tmp_path / HEATMAP_FILE))
    kind, columns, rows = fake.logged["sweep/trials"]
    assert [row[0] for row in rows] == [0, 1, 2, 3, 4] and columns[:3] == ["trial", "name", "status"]
    summarize(tmp_path)  # summarised again: the same W&B run
    assert fake.inits[1]["id"] == init["id"]


def test_summary_for_other_hardware_predicts_again_and_shards_the_draft(tmp_path: Path) -> None:
    from eaglet.plan.configs import load_hardware, load_model

    deployment = Deployment(load_model("llama3_1_8b"), load_draft("llama3_1_8b"), load_hardware("h200_x1"))
    written = _fake_sweep(tmp_path, deployment)
    result = summarize(tmp_path, hardware="b200_nvl8")
    b200 = Deployment(load_model("llama3_1_8b"), load_draft("llama3_1_8b"), load_hardware("b200_nvl8"))
    for row in result.rows:
        if row.status == "ok":
            assert row.speedup == predicted_speedups(b200, row.draft_vocab_size, written[row.trial]["tau"])
            assert row.speedup != written[row.trial]["speedup"]
    command = result.recommendation.command
    assert "--tensor-parallel-size 8" in command and '"draft_tensor_parallel_size": 8' in command


def test_speculative_config_follows_vllm() -> None:
    assert speculative_config("/d", 3, 1) == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}
    assert speculative_config("/d", 5, 4)["draft_tensor_parallel_size"] == 4


def test_summary_of_nothing_says_what_to_pass(tmp_path: Path, capsys) -> None:
    assert summarize_main([str(tmp_path / "nope")]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert summarize_main([str(tmp_path)]) == 2
    assert "no trial folders" in capsys.readouterr().err


# ---------------------------------------------------------------- the sweep files


@pytest.mark.parametrize(
    ("name", "sweeper"), [("draft_length_vocab", "BasicSweeper"), ("optuna_tau", "Optuna")]
)
def test_sweep_files_compose_into_multiruns(model_cache: Path, name: str, sweeper: str) -> None:
    import hydra
    from hydra.core.global_hydra import GlobalHydra

    import eaglet.config

    try:
        with hydra.initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
            cfg = hydra.compose("config", overrides=[f"sweeps={name}"], return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    assert cfg.sweep.enabled and cfg.hydra.mode.name == "MULTIRUN"
    assert sweeper in cfg.hydra.sweeper._target_
    assert cfg.hydra.launcher._target_ == "hydra_plugins.eaglet_launcher.TrialLogsLocalLauncher"  # submitit's
    assert set(cfg.hydra.sweeper.params) == {"trainer.ttt_steps", "draft.vocab_size"}
    # One folder per sweep, named after it: also the W&B group of its trials.
    assert Path(cfg.hydra.sweep.dir).name.startswith(f"{name}-")


def _job(*overrides: str):
    """A sweep job's composed config, Hydra's part included (as a multirun job sees it)."""
    import hydra
    from hydra.core.global_hydra import GlobalHydra

    import eaglet.config

    try:
        with hydra.initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
            return hydra.compose("config", overrides=list(overrides), return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def test_trials_are_named_by_their_swept_values(tmp_path: Path, monkeypatch) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from eaglet.config.trials import AXES_ENV, SweepAxes
    from eaglet.train.tracking import wandb_logger

    monkeypatch.delenv(AXES_ENV, raising=False)
    job = _job("sweeps=draft_length_vocab", "trainer.ttt_steps=5", "draft.vocab_size=8192", "seed=3")
    assert OmegaConf.select(job, "hydra.sweep.subdir") == "ttt5-vocab8192"  # seed is not swept
    # An axis given on the command line only: the sweep's start (its config, as Hydra hands it to callbacks)
    # passes it to every job.
    params = {"trainer.ttt_steps": "1,3,5", "draft.vocab_size": "1024,2048"}
    task = ["sweeps=draft_length_vocab", "trainer.lr=1e-4,3e-4", "seed=3"]
    SweepAxes().on_multirun_start(
        OmegaConf.create({"hydra": {"sweeper": {"params": params}, "overrides": {"task": task}}})
    )
    job = _job("sweeps=draft_length_vocab", "trainer.ttt_steps=1", "draft.vocab_size=64", "trainer.lr=3e-4")
    assert OmegaConf.select(job, "hydra.sweep.subdir") == "ttt1-vocab64-lr0.0003"
    # The trial's W&B run carries the same name, in the sweep's group.
    monkeypatch.setenv("WANDB_MODE", "offline")
    HydraConfig.instance().set_config(job)
    try:
        logger = wandb_logger(save_dir=str(tmp_path), project="p")
    finally:
        HydraConfig.instance().cfg = None
    assert logger._wandb_init["name"] == "ttt1-vocab64-lr0.0003"
    assert logger._wandb_init["group"] == Path(job.hydra.sweep.dir).name
    monkeypatch.delenv(AXES_ENV)
    optuna = _job("sweeps=optuna_tau", "trainer.ttt_steps=2", "draft.vocab_size=512", "hydra.job.num=3")
    assert OmegaConf.select(optuna, "hydra.sweep.subdir") == "3-ttt2-vocab512"  # optuna may repeat a setting


# ---------------------------------------------------------------- both sweeps end to end


@pytest.fixture(scope="module")
def smol_shards(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:
    """Small shards of the embedded default (SmolLM2-135M), written by the real extraction."""
    import hydra
    from hydra.core.global_hydra import GlobalHydra

    import eaglet.config
    from eaglet.extract.stage import run_extraction

    out = tmp_path_factory.mktemp("smol-shards")
    with hydra.initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
        cfg = hydra.compose("config", overrides=[f"paths.cache_dir={model_cache}", *_data(out)])
    GlobalHydra.instance().clear()
    run_extraction(cfg)
    return out


def _data(shards: Path) -> list[str]:
    return [
        "dataset=oasst_en100",
        "dataset.max_records_per_file=8",
        "extract.regenerate.enabled=false",
        "extract.max_length=192",
        f"extract.output_dir={shards}",
    ]


def _sweep(name: str, shards: Path, out: Path, cache: Path, *extra: str) -> Path:
    """Run `python train.py sweeps=<name>` with tiny settings; the sweep folder it wrote."""
    import os
    import subprocess
    import sys

    from eaglet.config import REPO_ROOT

    cmd = [
        sys.executable, str(REPO_ROOT / "train.py"), f"sweeps={name}", *_data(shards),
        f"paths.cache_dir={cache}", f"paths.output_dir={out}",
        "trainer.max_steps=2", "hardware.tokens_per_device=512", "trainer.global_batch_tokens=512",
        "trainer.val_fraction=0.3", "sweep.max_draft_length=3", *extra,
    ]  # fmt: skip
    # One thread per trial: the trials run side by side on a small machine.
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep_dir,) = (out / "multirun").glob(f"{name}-*")
    # Issue 22: the terminal said nothing of where a trial's output goes; each trial's folder links it.
    for trial_json in sweep_dir.glob("*/sweep_trial.json"):
        trial = trial_json.parent
        assert (
            f"sweep trial #{trial.name} (" in proc.stdout
            and f"output in {trial / 'trial.out'}" in proc.stdout
        )
        assert "sweep trial" in (trial / "trial.out").read_text() + (trial / "trial.err").read_text()
    return sweep_dir


def _trial_records(sweep_dir: Path) -> dict[int, dict]:
    """Each trial's record by its number; its folder is named by its swept values."""
    records = {}
    for path in sweep_dir.glob("*/sweep_trial.json"):
        record = json.loads(path.read_text())
        assert path.parent.name.endswith(f"ttt{record['ttt_steps']}-vocab{record['draft_vocab_size']}")
        assert record["name"] == f"ttt{record['ttt_steps']}-vocab{record['draft_vocab_size']}"
        records[record["trial"]] = {**record, "folder": path.parent}
    return records


def _check_summary(sweep_dir: Path, records: dict[int, dict]) -> dict:
    assert summarize_main([str(sweep_dir)]) == 0
    summary = json.loads((sweep_dir / SUMMARY_FILE).read_text())
    rows = {row["trial"]: row for row in summary["rows"]}
    assert sorted(rows) == sorted(records)
    for number, record in records.items():
        assert rows[number]["status"] == record["status"]
        assert rows[number]["tau"] == record.get("tau", [])
        assert rows[number]["speedup"] == record.get("speedup", [])
    best = _argmax(records)
    rec = summary["recommendation"]
    assert (rec["speedup"], rec["trial"], rec["draft_length"]) == best
    assert f'"num_speculative_tokens": {best[2]}' in rec["vllm"]
    assert (sweep_dir / HEATMAP_FILE).stat().st_size > 10_000
    return summary


@pytest.mark.e2e
def test_grid_sweep_end_to_end(smol_shards: Path, tmp_path: Path, model_cache: Path) -> None:
    # 100000 exceeds SmolLM2's vocab: those trials fail, and the study goes on.
    sweep_dir = _sweep(
        "draft_length_vocab", smol_shards, tmp_path, model_cache,
        "trainer.ttt_steps=1,2", "draft.vocab_size=64,100000", "hydra.sweeper.max_batch_size=4",
        "eval.sets=[math]", "eval.prompts_per_set=1", "eval.max_new_tokens=8",
    )  # fmt: skip
    records = _trial_records(sweep_dir)
    assert len(records) == 4
    ok = {n: r for n, r in records.items() if r["status"] == "ok"}
    failed = {n: r for n, r in records.items() if r["status"] == "failed"}
    assert {(r["ttt_steps"], r["draft_vocab_size"]) for r in ok.values()} == {(1, 64), (2, 64)}
    assert all("exceeds the target vocab size" in r["error"] for r in failed.values()) and len(failed) == 2
    for r in ok.values():
        decode = r["decode"]
        # Measured at every serving draft length; the replay reproduces real decoding at the longest.
        assert len(r["tau"]) == 3 and r["tau"] == decode["tau"] and len(r["sim"]["tau"]) == 3
        assert [len(rates) for rates in decode["acceptance_rates"]] == [1, 2, 3]
        assert decode["tau"][-1] == pytest.approx(decode["measured_at_max_draft_length"]["tau"])
        assert r["best_draft_length"] == 1 + r["speedup"].index(max(r["speedup"]))
        assert r["objective_value"] == max(r["speedup"]) and 0 < r["vocab_coverage"] <= 1
    _check_summary(sweep_dir, records)


@pytest.mark.e2e
def test_optuna_sweep_end_to_end(smol_shards: Path, tmp_path: Path, model_cache: Path) -> None:
    # Sampled with seed 0: (2, 64), then (2, 100000), which fails; the study goes on.
    sweep_dir = _sweep(
        "optuna_tau", smol_shards, tmp_path, model_cache,
        "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2",
        "trainer.ttt_steps=choice(1,2)", "draft.vocab_size=choice(64,100000)", "sweep.tau_source=sim",
        # Each trial runs DDP over two processes that submitit starts (never DDP inside the sweep's process).
        "hardware.devices=2", "hydra.launcher.tasks_per_node=2", "trainer.global_batch_tokens=1024",
    )  # fmt: skip
    records = _trial_records(sweep_dir)
    ok = {n: r for n, r in records.items() if r["status"] == "ok"}
    assert sorted((r["ttt_steps"], r["draft_vocab_size"], r["status"]) for r in records.values()) == [
        (2, 64, "ok"), (2, 100000, "failed"),
    ]  # fmt: skip
    for r in ok.values():
        assert r["decode"] is None and r["tau"] == r["sim"]["tau"] and r["objective"] == "speedup"
        assert r["train"]["global_batch_tokens"] == 1024 and r["train"]["steps"] == 2
        # Two ranks trained; rank 0 alone wrote the metrics and measured.
        assert len(list(r["folder"].rglob("metrics.csv"))) == 1
    logs = (sweep_dir / ".submitit").rglob("*_log.err")
    assert sum("GLOBAL_RANK: 1, MEMBER: 2/2" in log.read_text() for log in logs) == len(ok)
    # The study maximised what the trials returned (their predicted speedup) and counted the failure.
    import yaml

    result = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert result["best_value"] == pytest.approx(max(r["objective_value"] for r in ok.values()))
    _check_summary(sweep_dir, records)
