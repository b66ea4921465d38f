"""Evaluation through a serving engine, against a stand-in server (tests/stand_in_server.py) that serves vLLM's
and SGLang's endpoints and speculative-decoding metrics with counts the test sets; and the sweep's choice of
where τ comes from when the target cannot load in this process."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from eaglet.config import REPO_ROOT
from eaglet.errors import ConfigError
from eaglet.evaluate.server_metrics import sglang_counts, vllm_snapshot
from eaglet.evaluate.stage import plot_acceptance, run_evaluation

STAND_IN = Path(__file__).resolve().parent / "stand_in_server.py"
K = 3
# Counts one request adds: τ = 1 + accepted / drafts, position i accepted_i / drafts.
PLAN = {
    "eagle3": {"drafts": 4, "accepted_per_pos": [3, 2, 1]},  # τ 2.5, rates .75 .5 .25
    "ngram": {"drafts": 5, "accepted_per_pos": [2, 1, 0]},  # τ 1.6, rates .4 .2 0
    "answer_tokens": 10,
}
EAGLE = (2.5, [0.75, 0.5, 0.25])
NGRAM = (1.6, [0.4, 0.2, 0.0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_plan(tmp_path: Path, **changes) -> Path:
    path = tmp_path / f"plan-{len(list(tmp_path.glob('plan-*')))}.json"
    path.write_text(json.dumps({**PLAN, **changes}))
    return path


@pytest.fixture
def start_stand_in(tmp_path: Path) -> Iterator:
    """start_stand_in(engine, *engine_args, plan=...) -> its URL; every server is stopped after the test."""
    started: list[subprocess.Popen] = []

    def start(engine: str, *args: str, plan: Path | None = None) -> str:
        command = [sys.executable, str(STAND_IN), "--plan", str(plan or write_plan(tmp_path)), engine, *args]
        proc = subprocess.Popen([*command, "--port", "0"], stdout=subprocess.PIPE, text=True)
        started.append(proc)
        for line in proc.stdout:
            if line.startswith("listening on"):
                return f"http://{line.split()[-1]}"
        raise AssertionError(f"the stand-in server did not start: {command}")

    yield start
    for proc in started:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run as far as the server path reads one: a head folder (the servers load it, not eaglet)."""
    run = tmp_path_factory.mktemp("outputs") / "train" / "run"
    (run / "draft").mkdir(parents=True)
    (run / "draft" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    return run


def overrides(run: Path, *extra: str) -> list[str]:
    return [
        "model=tiny_llama",
        "dataset=oasst_en100",
        "dataset.max_records_per_file=30",
        "extract.regenerate.enabled=false",
        f"paths.output_dir={run.parent.parent}",
        f"eval.run={run}",
        "eval.sets=[code,math]",
        "eval.prompts_per_set=2",
        "eval.max_new_tokens=12",
        f"eval.num_spec_tokens={K}",
        *extra,
    ]


def check_result(result: dict, expected: tuple[float, list[float]], prompts: int = 2) -> None:
    tau, rates = expected
    assert result["tau"] == pytest.approx(tau)
    assert result["acceptance_rates"] == pytest.approx(rates)
    assert result["new_tokens"] == 10 * prompts and result["tokens_per_forward"] is None


# ---------------------------------------------------------------- evaluate.py against running servers


@pytest.mark.e2e
def test_evaluate_py_reads_vllm_metrics_of_running_servers(
    start_stand_in, run_dir: Path, model_cache: Path
) -> None:
    """The entry point, connected to three stand-in vLLM servers: the head's, n-gram's and one without
    speculation. τ and per-position acceptance are differences of the counters (which start non-zero)."""
    eagle = start_stand_in(
        "vllm", "tiny", "--speculative-config", json.dumps({"method": "eagle3", "num_speculative_tokens": K})
    )
    ngram = start_stand_in(
        "vllm", "tiny", "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": K})
    )
    greedy = start_stand_in("vllm", "tiny")
    (run_dir / "eval.json").unlink(missing_ok=True)
    cmd = [
        sys.executable, str(REPO_ROOT / "evaluate.py"), *overrides(run_dir), f"paths.cache_dir={model_cache}",
        "eval.backend=vllm_server", f"eval.server.url={eagle}", f"eval.server.ngram_url={ngram}/v1",
        f"eval.server.greedy_url={greedy}",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "WANDB_MODE": "disabled"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run_dir / "eval.json").read_text())
    assert results["backend"] == "vllm_server" and results["server"]["engine"] == "vllm"
    assert "vllm:spec_decode_num_drafts" in results["server"]["measured"]
    for entry in results["sets"].values():
        assert entry["prompts"] == 2 and set(entry["results"]) == {"eaglet", "ngram"}
        check_result(entry["results"]["eaglet"], EAGLE)
        check_result(entry["results"]["ngram"], NGRAM)
        eaglet = entry["results"]["eaglet"]
        assert eaglet["steps"] == 8 and eaglet["accepted"] == 12 and eaglet["proposed"] == 24
        assert (
            eaglet["mismatches"] == 0
            and eaglet["compared_with"] == "greedy"
            and eaglet["other_requests"] == 0
        )
        assert eaglet["speedup"] > 0 and entry["greedy"]["new_tokens"] == 20
    assert (run_dir / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    # A server counts totals only: no interval over prompts, the ratio to n-gram lookup's τ without one.
    ngram_tau = results["sets"]["code"]["results"]["ngram"]["tau"]
    assert f"| eaglet | 2.50 | n/a | {2.5 / ngram_tau:.2f} | 0.75 | 0.50 | 0.25 | n/a |" in proc.stdout
    assert "--speculative-config" in proc.stdout  # the serve commands, as after in-process evaluation


def test_sglang_counts_come_from_each_answers_meta_info(compose, start_stand_in, run_dir: Path) -> None:
    eagle = start_stand_in(
        "sglang",
        "--model-path",
        "tiny",
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-num-draft-tokens",
        str(K + 1),
    )
    cfg = compose(*overrides(run_dir, "eval.backend=sglang_server", f"eval.server.url={eagle}"))
    results = run_evaluation(cfg)
    for entry in results["sets"].values():
        eaglet = entry["results"]["eaglet"]
        check_result(eaglet, EAGLE)
        # SGLang's own figure: completion tokens per verification step (10 tokens over 4 steps a request).
        assert eaglet["engine_accept_length"] == pytest.approx(2.5) and eaglet["speedup"] is None
        assert eaglet["mismatches"] is None and "greedy" not in entry
    assert plot_acceptance(results, run_dir / "acceptance-sglang.png").stat().st_size > 1000


def test_lossless_check_counts_prompts_whose_text_differs(
    compose, start_stand_in, tmp_path: Path, run_dir: Path
) -> None:
    plan = write_plan(tmp_path, differ_after={"eagle3": 3})  # the 4th timed answer: math's second prompt
    eagle = start_stand_in(
        "vllm",
        "tiny",
        "--speculative-config",
        json.dumps({"method": "eagle3", "num_speculative_tokens": K}),
        plan=plan,
    )
    greedy = start_stand_in("vllm", "tiny")
    results = run_evaluation(
        compose(
            *overrides(
                run_dir,
                "eval.backend=vllm_server",
                f"eval.server.url={eagle}",
                f"eval.server.greedy_url={greedy}",
            )
        )
    )
    assert results["sets"]["code"]["results"]["eaglet"]["mismatches"] == 0
    assert results["sets"]["math"]["results"]["eaglet"]["mismatches"] == 1


@pytest.mark.parametrize(
    ("server", "role", "message"),
    [
        ("vllm_plain", "url", "runs without speculative decoding"),
        ("vllm_k5", "url", "drafts 5 tokens"),
        ("vllm_eagle", "greedy_url", "decodes speculatively"),
    ],
)
def test_a_server_that_is_not_what_its_key_says_is_refused(
    compose, start_stand_in, run_dir, server, role, message
) -> None:
    args = {
        "vllm_plain": ["tiny"],
        "vllm_k5": [
            "tiny",
            "--speculative-config",
            json.dumps({"method": "eagle3", "num_speculative_tokens": 5}),
        ],
        "vllm_eagle": [
            "tiny",
            "--speculative-config",
            json.dumps({"method": "eagle3", "num_speculative_tokens": K}),
        ],
    }[server]
    url = start_stand_in("vllm", *args)
    head = (
        url
        if role == "url"
        else start_stand_in(
            "vllm",
            "tiny",
            "--speculative-config",
            json.dumps({"method": "eagle3", "num_speculative_tokens": K}),
        )
    )
    keys = [f"eval.server.url={head}"] + ([f"eval.server.greedy_url={url}"] if role == "greedy_url" else [])
    with pytest.raises(ConfigError, match=message):
        run_evaluation(compose(*overrides(run_dir, "eval.backend=vllm_server", *keys)))


def test_no_server_at_the_url_says_how_to_start_one(compose, run_dir: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError) as exc:
        run_evaluation(compose(*overrides(run_dir, "eval.backend=vllm_server", f"eval.server.url={url}")))
    message = str(exc.value)
    assert f"no vLLM server answers at {url}" in message and "eval.server.url" in message
    assert "vllm serve TARGET" in message and '"method": "eagle3"' in message


# ---------------------------------------------------------------- servers eaglet launches


def launch_overrides(tmp_path: Path, run: Path, engine: str, plan: Path, *extra: str) -> list[str]:
    executable = f"[{sys.executable},{STAND_IN},--plan,{plan},{engine}]"
    return overrides(
        run,
        f"eval.backend={engine}_server",
        "eval.server.model=tiny",
        f"eval.server.executable={executable}",
        f"eval.server.port={free_port()}",
        f"eval.server.log_dir={tmp_path / 'logs'}",
        *extra,
    )


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_launched_servers_one_per_role(compose, tmp_path: Path, run_dir: Path, engine: str) -> None:
    """Greedy, head and n-gram servers started in turn with the engine's own command line (the stand-in
    parses it), each polled until ready (the first answers only after a delay) and stopped after."""
    plan = write_plan(tmp_path, startup_delay_s=1.5)
    results = run_evaluation(compose(*launch_overrides(tmp_path, run_dir, engine, plan)))
    for entry in results["sets"].values():
        check_result(entry["results"]["eaglet"], EAGLE)
        check_result(entry["results"]["ngram"], NGRAM)
        assert entry["results"]["eaglet"]["mismatches"] == 0 and entry["results"]["eaglet"]["speedup"] > 0
    servers = results["server"]["servers"]
    assert list(servers) == ["greedy", "eaglet", "ngram"]
    draft = str((run_dir / "draft").resolve())
    if engine == "vllm":
        assert "--speculative-config" not in servers["greedy"] and draft in servers["eaglet"]
        assert '"method": "ngram"' in servers["ngram"] and '"prompt_lookup_max": 4' in servers["ngram"]
    else:
        assert f"--speculative-draft-model-path {draft}" in servers["eaglet"]
        assert "--speculative-algorithm NGRAM" in servers["ngram"]
    assert (tmp_path / "logs" / "eaglet.log").read_text().startswith(f"stand-in {engine} server")


def test_a_server_that_dies_at_start_ends_in_its_log_tail(compose, tmp_path: Path, run_dir: Path) -> None:
    plan = write_plan(tmp_path, exit_at_start="torch.OutOfMemoryError: CUDA out of memory (stand-in)")
    with pytest.raises(ConfigError) as exc:
        run_evaluation(compose(*launch_overrides(tmp_path, run_dir, "vllm", plan)))
    message = str(exc.value)
    assert "the greedy server exited with status 1 before it answered" in message
    assert "CUDA out of memory (stand-in)" in message and str(tmp_path / "logs" / "greedy.log") in message


def test_a_server_that_never_answers_times_out_with_its_log(compose, tmp_path: Path, run_dir: Path) -> None:
    plan = write_plan(tmp_path, startup_delay_s=60)
    cfg = compose(*launch_overrides(tmp_path, run_dir, "vllm", plan, "eval.server.startup_timeout_s=1.5"))
    with pytest.raises(
        ConfigError,
        match=r"did not answer .*/health within eval.server.startup_timeout_s=1.5 s(.|\n)*stand-in vllm server",
    ):
        run_evaluation(cfg)


def test_a_missing_engine_says_what_to_install(compose, tmp_path: Path, run_dir: Path) -> None:
    cfg = compose(*overrides(run_dir, "eval.backend=vllm_server", "eval.server.model=tiny", f"eval.server.port={free_port()}",
                             "eval.server.executable=[/nonexistent/vllm,serve]", f"eval.server.log_dir={tmp_path}"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"cannot start the greedy server.*install the engine"):
        run_evaluation(cfg)


def test_launching_needs_a_target_to_serve(compose, run_dir: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"names no weights folder; set model.path=.* or eval.server.model="
    ):
        run_evaluation(compose(*overrides(run_dir, "eval.backend=vllm_server")))


# ---------------------------------------------------------------- the metrics formats


def test_vllm_counters_are_summed_over_engines_and_differenced() -> None:
    text = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 6.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 48.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 7.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 5.0
"""
    after = vllm_snapshot(text)
    assert (after.drafts, after.draft_tokens, after.accepted, after.requests) == (16, 48, 20, 5)
    assert after.accepted_per_pos == [12, 7, 1]
    before = vllm_snapshot(text.replace(" 10.0", " 2.0").replace('position="0"} 9.0', 'position="0"} 1.0'))
    delta = after - before
    assert (
        delta.drafts == 8 and delta.accepted_per_pos == [8, 0, 0] and delta.acceptance_rates() == [1.0, 0, 0]
    )
    assert vllm_snapshot('vllm:num_requests_running{engine="0"} 0.0\n') is None


def test_sglang_meta_info_of_each_release() -> None:
    newest = {"completion_tokens": 9, "spec_verify_ct": 4, "spec_num_correct_drafts": 6,
              "spec_num_proposed_drafts": 12, "spec_correct_drafts_histogram": [1, 1, 1, 1]}  # fmt: skip
    counts = sglang_counts(newest, 3)
    assert counts.tau == 2.5 and counts.accepted_per_pos == [3, 2, 1] and counts.draft_tokens == 12
    older = {
        "completion_tokens": 9,
        "spec_verify_ct": 4,
        "spec_accept_token_num": 6,
        "spec_accept_histogram": [1, 1, 1, 1],
    }
    assert sglang_counts(older, 3).accepted_per_pos == [3, 2, 1]
    oldest = sglang_counts({"completion_tokens": 9, "spec_verify_ct": 4}, 3)
    assert oldest.accepted is None and oldest.tau == 9 / 4 and oldest.acceptance_rates() == []
    assert sglang_counts({"completion_tokens": 9}, 3) is None


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("override", "key"), [("eval.server.ulr=http://x:1", "ulr"), ("eval.backend=vllm", "backend")]
)
def test_a_typo_in_the_server_settings_names_the_key(compose, override: str, key: str) -> None:
    with pytest.raises(ConfigCompositionException) as exc:
        compose(override)
    assert key in str(exc.value) + str(exc.value.__cause__)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["eval.server.url=http://h:1"], "eval.backend=in_process loads the target in this process"),
        (
            ["eval.backend=vllm_server", "eval.server.url=h:1"],
            "eval.server.url='h:1': expected http://host:port",
        ),
        (["eval.backend=vllm_server", "eval.server.ngram_url=http://h:1"], "without eval.server.url"),
        (["eval.backend=vllm_server", "eval.server.launch=[]"], "eval.server.launch is empty"),
        (["eval.backend=vllm_server", "eval.server.launch=[eaglet,eaglet]"], "more than once"),
        (["eval.backend=sglang_server", "eval.server.launch=[baseline]"], "eval.baseline_draft is unset"),
        (["eval.backend=vllm_server", "eval.server.port=0"], "eval.server.port must be in [1, 65535]"),
    ],
)
def test_server_settings_are_checked_before_any_work(compose, settings: list[str], message: str) -> None:
    with pytest.raises(
        ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
    ):
        compose(*settings)


# ---------------------------------------------------------------- sweeps: where τ comes from


@pytest.mark.parametrize(
    ("settings", "source", "why"),
    [
        (["model=tiny_llama"], "decode", "loads in this process"),
        (["model=kimi_k2_5", "hardware=b200_nvl8"], "sim", "weights take about 2,080 GB"),
        (
            ["model=kimi_k2_5", "model.path=/m", "hardware=b200_nvl8", "eval.backend=vllm_server"],
            "server",
            "vLLM server",
        ),
        (["model=tiny_llama", "extract.backend=vllm"], "sim", "extract.backend=vllm"),
        (["model=llama3_1_8b", "hardware=h200_x1"], "sim", "no model.path"),
        (["model=llama3_1_8b", "model.path=/m", "hardware=h200_x1"], "decode", "loads in this process"),
        (["model=kimi_k2_5", "sweep.tau_source=sim"], "sim", "sweep.tau_source=sim"),
    ],
)
def test_a_sweep_chooses_where_tau_comes_from(compose, settings: list[str], source: str, why: str) -> None:
    from eaglet.sweeps.tau_source import choose_tau_source

    choice = choose_tau_source(compose("sweep.enabled=true", *settings))
    assert choice.source == source and why in choice.reason, choice


def test_a_sweep_cannot_measure_new_heads_on_a_running_server(compose) -> None:
    from eaglet.sweeps.tau_source import choose_tau_source

    with pytest.raises(ConfigError, match="leave eval.server.url unset"):
        choose_tau_source(
            compose("model=tiny_llama", "eval.backend=vllm_server", "eval.server.url=http://h:1")
        )


def test_a_kimi_trial_says_before_training_that_it_measures_on_shards(
    compose, tmp_path: Path, monkeypatch, caplog
) -> None:
    """Issue 22: every trial of a Kimi sweep used to train and then fail loading the target in-process."""
    import eaglet.sweeps.trial as trial

    trained = []
    monkeypatch.setattr(
        trial,
        "run_training",
        lambda *a, **k: trained.append(1) or (_ for _ in ()).throw(RuntimeError("stop")),
    )
    monkeypatch.setattr(trial, "finish_wandb", lambda failed: None)
    cfg = compose("sweep.enabled=true", "model=kimi_k2_5", "hardware=h200_x1")
    with caplog.at_level(logging.INFO, logger="eaglet.sweeps.trial"):
        assert trial.run_trial(cfg, tmp_path / "0") is None
    record = json.loads((tmp_path / "0" / trial.TRIAL_FILE).read_text())
    assert record["tau_source"] == "sim" and "more than 85% of one H200" in record["tau_source_reason"]
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sweep: τ from")]
    assert line.startswith("sweep: τ from sim: the target's weights") and "eval.backend=vllm_server" in line
    assert trained == [1]  # the choice came first, then training


def test_a_trial_head_through_a_launched_server(compose, tmp_path: Path, run_dir: Path) -> None:
    """The sweep's server path: one server at K_max with the trial's head, τ(K) from prefix sums."""
    from eaglet.sweeps.served import prefix_taus, server_curve

    cfg = compose(*launch_overrides(tmp_path, run_dir, "vllm", write_plan(tmp_path)), "sweep.enabled=true")
    curve = server_curve(cfg, run_dir / "draft", K)
    assert curve["tau"] == pytest.approx([1.75, 2.25, 2.5]) and curve["prompts"] == {"code": 2, "math": 2}
    assert curve["measured_at_max_draft_length"]["tau"] == pytest.approx(2.5)
    assert prefix_taus([0.5, 0.25]) == [1.5, 1.75]
    assert (tmp_path / "logs" / "eaglet.log").is_file()
