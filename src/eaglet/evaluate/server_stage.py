"""Evaluation through a serving engine (eval.backend=vllm_server|sglang_server), for targets this process
cannot hold: the prompts, report, plot and eval.json of in-process evaluation, measured on vLLM or SGLang
servers (eaglet.evaluate.server_plan says which, eaglet.evaluate.server_results how)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglet.config.schema import EagletConfig
from eaglet.errors import ConfigError, DataError
from eaglet.evaluate.metrics import format_table
from eaglet.evaluate.prompts import load_prompt_sets
from eaglet.evaluate.server_metrics import SpecCounts
from eaglet.evaluate.server_plan import ENGINE_NAMES, engine_of, planned_servers
from eaglet.evaluate.server_results import MEASURED, SPECULATIVE_ROLES, SetRun, measure_server, set_results
from eaglet.fsutil import atomic_write_json
from eaglet.run_dir import RunDir
from eaglet.target_model import load_tokenizer


def run_server_evaluation(cfg: EagletConfig, run: RunDir) -> dict[str, Any]:
    """Evaluate the run's head through the engine of eval.backend; results to <run>/eval.json and returned."""
    ev, engine = cfg.eval, engine_of(cfg)
    # Only the tokenizer is loaded here: prompts go to the servers as the token ids in-process evaluation decodes.
    prompt_sets = load_prompt_sets(cfg, load_tokenizer(cfg.model, Path(cfg.paths.cache_dir)))
    log_dir = Path(ev.server.log_dir) if ev.server.log_dir else run.path / "server_logs"
    runs: dict[str, dict[str, SetRun]] = {}
    where: dict[str, str] = {}
    for role, location, server in planned_servers(cfg, run.draft_dir, ev.num_spec_tokens, log_dir):
        with server as client:
            where[role] = location
            runs[role] = measure_server(
                client, role, prompt_sets, k=ev.num_spec_tokens, max_new_tokens=ev.max_new_tokens
            )
    if not any(role in runs for role in SPECULATIVE_ROLES):
        raise ConfigError("no speculative server was measured: list eaglet (or ngram) in eval.server.launch")
    results: dict[str, Any] = {
        "run": str(run.path),
        "num_spec_tokens": ev.num_spec_tokens,
        "backend": str(ev.backend),
        "server": {"engine": engine, "servers": where, "measured": MEASURED[engine]},
        "sets": set_results(prompt_sets, runs, engine),
    }
    print_report(results)
    atomic_write_json(run.results_file, results)
    return results


def print_report(results: dict[str, Any]) -> None:
    for name, entry in results["sets"].items():
        print(
            f"\n{name}: {entry['prompts']} prompts ({entry['overlap_dropped']} overlapping training prompts dropped)"
        )
        print(format_table(entry["results"]))
        for role, r in entry["results"].items():
            if r["mismatches"]:
                print(
                    f"lossless check: {role}'s text differs from the {r['compared_with']} server's on "
                    f"{r['mismatches']} of {entry['prompts']} prompts"
                )
            if r.get("other_requests"):
                print(
                    f"note: {r['other_requests']} requests of other clients finished on the {role} server during "
                    "this set; their drafts are in its counts"
                )
    server = results["server"]
    print(f"\nmeasured through {ENGINE_NAMES[server['engine']]}: {server['measured']}")


def measure_draft_through_server(
    cfg: EagletConfig, draft_dir: Path, k: int
) -> tuple[SpecCounts, dict[str, int]]:
    """A head (a sweep trial's) through one server eaglet launches drafting k tokens: counts over every eval set,
    and the prompts of each set."""
    prompt_sets = load_prompt_sets(cfg, load_tokenizer(cfg.model, Path(cfg.paths.cache_dir)))
    log_dir = Path(cfg.eval.server.log_dir) if cfg.eval.server.log_dir else draft_dir.parent / "server_logs"
    total = SpecCounts()
    for _, _, server in planned_servers(cfg, draft_dir, k, log_dir, roles=["eaglet"]):
        with server as client:
            runs = measure_server(client, "eaglet", prompt_sets, k=k, max_new_tokens=cfg.eval.max_new_tokens)
        for run in runs.values():
            total = total + (run.counts or SpecCounts())
    if not total.drafts:
        raise DataError(
            f"the {ENGINE_NAMES[engine_of(cfg)]} server drafted nothing for {draft_dir} on eval.sets="
            f"{list(cfg.eval.sets)}; see its log in {log_dir}"
        )
    return total, {name: len(prompts) for name, (prompts, _) in prompt_sets.items()}
