"""The embedded target at scale, online, in one command that can be reissued: data, the head, a data-scaling curve,
ablations and the speculators column, each evaluated against the real target beside n-gram lookup.

    python recipes/smollm2_scale.py deadline_s=540      # on one H200; reissue the same command until it says done
    python recipes/smollm2_scale.py rows=main main_epochs=2

Work, most important first (src/eaglet/conf/experiments/smollm2_scale.yaml has the data and its time estimates):
- data:   `python extract.py experiments=smollm2_scale`: every shared prompt and 200K self-prompted ones, greedy and
          sampled answers, token streams into <out>/tokens/main (5 B a token).
- main:   `python train.py experiments=smollm2_scale` online for `main_epochs` epochs, then `python evaluate.py`
          (fp32 target, every prompt of each held-out set, K = 4) beside n-gram lookup.
- scale_small, scale_mid: the same settings on `small_tokens` and `mid_tokens` tokens, each seen once
          (trainer.max_steps = tokens / trainer.global_batch_tokens: a random subset of the same data, in the same
          order of draws and the same schedule shape as the head's).
- shared_only: shared prompts only (no self-prompted ones), `small_tokens` tokens: against scale_small.
- greedy_only: greedy answers only (no sampled ones), `mid_tokens` tokens: against scale_mid.
- ttt7:   K = 7 training steps instead of 5, `mid_tokens` tokens: against scale_mid.
- quarter_data: a fixed random quarter of the training sequences (trainer.train_fraction=0.25), `mid_tokens` tokens:
          against scale_mid, at equal tokens seen, what repeats cost against new data (on the 29.6M-token seeded
          store each sequence is seen ~2.8 times, against scale_mid's 0.7).
- seed_mid: scale_mid with another training seed (trainer.seed=4: the head's initialisation and its batches' order;
          the data and the validation split unchanged), `mid_tokens` tokens: against scale_mid, how far τ moves
          between two trainings that differ only by luck.
- seeded: the self-prompts written after three people's chat prompts each (extract.self_prompt.examples=3 from the
          shared chat sets, temperature 0.7), `mid_tokens` tokens: against scale_mid.
- people_x4: four answers (greedy and three sampled) to every shared prompt, the self-prompts' greedy ones only,
          `mid_tokens` tokens: against scale_mid.
- vocab16384: a draft vocab of 16384 instead of 8192, `mid_tokens` tokens: against scale_mid.
- speculators: the speculators package's head on the data and steps of `speculators_row`
          (benchmarks/side_by_side_speculators.py), evaluated beside that row's head in the same run.
The report, <out>/scale.md (and scale.json), lists τ per set, per-position acceptance and the lossless count for
every row, the n-gram baseline, the ratios against the goal, and what was not run.

Time: on one H200 the data measured 14 minutes (850 s, 2026-12-04), online training 136K tokens/s (~8.5 min an epoch of
its 69M tokens) with the head eager; compiled on 32K micro-batches (the experiment's setting now) 247K tokens/s on
an H100 (2026-12-07), so ~4.7 min an epoch; evaluation 8.5 s a prompt on the GPU with the fp32 target in one
process (measured 2026-12-04: eval_prompts=20, 80 prompts, ~11 minutes), 146-166 s for the same 80 prompts with
`eval_workers=4` processes side by side (H100, 2026-12-06/07). A head can also be evaluated on another machine (it
comes back as a folder: evaluate.py eval.run=<it> eval.device=cpu). Measured on one H100 (2026-12-07, the head
compiled, 20 prompts a set): scale_small 1.5 min of training (half of it compiling the head, once per machine)
and 2.8 of evaluation, scale_mid 1.9 and 2.5, shared_only 1.2 to tokenize its store (the answers reused), 1.1 and
2.7; the data with 30K self-prompts 5-6; greedy_only 1 to tokenize its store, 1.9 and 2.2, ttt7 2.5 (half a
minute of it compiling the K = 7 head) and 2.2 (eight evaluation workers; a later session, 2026-12-07); the data
4.1 and main at 8 epochs 18 (7,200 steps, 236M tokens at 228K tokens/s over the run) and 2.2 (a third); the data
4.0, scale_mid 2.0 and 2.3, quarter_data 2.2 and 2.2, the speculators pair's training 5.3 (a fifth). Estimated
for the other rows: seed_mid ~4 (as scale_mid), seeded ~7 (its own self-prompts and their answers, ~3; the shared answers reused), people_x4 ~7 (three sampled
answers to each of ~15K multi-turn conversations, not measured), vocab16384 ~4.5, speculators ~9 (both heads
trained side by side on the same batches, then an evaluation of both beside n-gram lookup). Each row includes ~0.5 min of
start-up. Within one 30-minute session (the data made again on a bare machine) the data and the main head fit, or
the data and three of the other rows; the rest take further sessions.

`budget_s=B`: the whole recipe, over every invocation, ends within B seconds of its first start (<out>/budget.json
holds that start): the main head trains for the time left then (less `eval_reserve_s` for its last validation
and its evaluation), at most `main_epochs` epochs, its learning-rate schedule fitted to that time at the run's own
measured step rate (trainer.fit_steps_to_time; `train_tokens_per_s` only estimates the steps for the report); rows
not started in time are left.

`main_init_from=<draft folder>`: the main head starts from a head trained before (an earlier session's main
draft/, brought back) rather than from the target's rows (trainer.init_from): sessions of 30 minutes add their
steps, each on its own freshly written data; the report's overrides column says so.

`earlier=<scale.json>`: an ablation's reference row that this run does not run (say scale_mid, for ttt7) is taken
from an earlier run's scale.json (experiments/smollm2_scale.<date>.json), when the store it trained on came out the
same here (the same sequences, tokens and answer tokens: the data made again with the same seed and options), so
one session can run `rows=ttt7,greedy_only earlier=...` without training scale_mid again. A run of a data-scaling
row (scale_small, scale_mid, main) takes the others from there too, so that `rows=main earlier=...` reports the
whole curve. The report names the file beside the row; a store that differs leaves the row out and says why.

`deadline_s=S`: no command starts with less than `min_start_s` seconds left of the S this invocation may run, and
one still running at S is stopped (every stage resumes: extraction and answers where they were, training from its
last.ckpt); the invocation then writes the report, says what is left and exits 0. Reissuing the same command
continues; finished work is never redone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf
from scale_report import SPECULATORS, format_report
from smollm2_gpu import (
    ROOT,
    DeadlineReached,
    common_overrides,
    evaluate,
    parse_options,
    sh,
    train,
    train_speculators,
)

from eaglet.config import CONF_DIR
from eaglet.plan.quality import on_the_curve
from eaglet.run_dir import RunDir
from eaglet.shards.manifest import MANIFEST_FILE

OPTS = {"experiment": "smollm2_scale", "out": "outputs/smollm2_scale", "rows": "", "deadline_s": "0",
        "min_start_s": "45", "main_epochs": "1", "small_tokens": "5000000", "mid_tokens": "20000000",
        "speculators_row": "scale_mid", "eval_prompts": "all", "eval_device": "cuda", "eval_workers": "8", "gpu": "0",
        "extra": "", "budget_s": "0", "train_tokens_per_s": "230000", "eval_reserve_s": "300",
        "main_init_from": "", "earlier": ""}  # fmt: skip
# `rows`: which rows to run (empty: all, in ROWS' order, then speculators); `extra`: overrides for every command
# (a row's own win over them), e.g. a CPU smoke run: extra="hardware=cpu dataset=oasst_en100 ...".
# `train_tokens_per_s`: online training's rate at the experiment's settings over the whole stage, compile,
# validations and checkpoints included (the head compiled on 32K micro-batches: 247K on an H100 over a 610-step row
# with one validation, so 230K for a longer run's more validations and checkpoints; experiments/BENCHMARKS.md): the main
# head's planned steps in the report (its schedule is fitted to the time it is given); `eval_reserve_s`: the head's last
# validation, export and evaluation; `eval_workers`: evaluation processes side by side on the GPU (eval.workers;
# one when eval_device=cpu; eight took 133 s for 80 prompts on an H100 where four took 146-166 s).
# `main_init_from`: a trained head's folder (a main row's draft/ of an earlier session) that the main head starts
# from (trainer.init_from): its steps add to that head's; "" = from the target.
# `earlier`: an earlier run's scale.json, whose rows stand in for those this run's ablations are measured against.
BUDGET_FILE = "budget.json"

# The shared sets of people's first chat prompts (the rest are maths and code; with ShareGPT's many later turns,
# "continue", "make it shorter", among the examples the target writes odder prompts: BENCHMARKS.md).
CHAT_PROMPT_FILES = ("alpaca_en_demo", "oasst_en100", "oasst_prompt_lottery", "self_instruct_seed")

# Token stores: what each changes against the experiment's data (under <out>/tokens/<name>). Answers are reused
# from data/regenerated/ and data/self_prompted/, so only the main store generates.
STORES: dict[str, tuple[str, ...]] = {
    "main": (),
    "shared_only": ("extract.self_prompt.num_prompts=0",),
    "greedy_only": ("extract.regenerate.samples_per_prompt=1",),
    # Self-prompts written after 3 people's chat prompts (the shared chat sets, evaluation prompts left out; at the
    # temperature that keeps a 135M target coherent): requests like people's, whose answers the head predicts as
    # poorly as it does human prompts'.
    "seeded": (
        "extract.self_prompt.examples=3",
        "extract.self_prompt.example_paths=["
        + ",".join(f"${{paths.shared_data}}/{name}.jsonl" for name in CHAT_PROMPT_FILES)
        + "]",
        "extract.self_prompt.temperature=0.7",
        "extract.self_prompt.top_p=0.9",
    ),
    # Three sampled answers to every shared prompt (people's) besides the greedy one, none to self-written prompts:
    # more of the target's answers to the kind of prompt its head predicts worst.
    "people_x4": (
        "extract.regenerate.samples_per_prompt=4",
        "extract.regenerate.sampled_from=dataset",
        "extract.regenerate.sampled_conversations=null",
    ),
}


@dataclass(frozen=True)
class Row:
    """One trained head of the report: its data, its overrides and how many tokens it sees."""

    question: str
    store: str = "main"
    overrides: tuple[str, ...] = ()
    tokens: str | None = None  # the option holding the tokens it trains on once; None: `main_epochs` epochs
    against: str | None = None  # the row it is an ablation of, at equal tokens


ROWS: dict[str, Row] = {
    "main": Row("the head: all the data, `main_epochs` epochs"),
    "scale_small": Row("data scaling", tokens="small_tokens"),
    "scale_mid": Row("data scaling", tokens="mid_tokens"),
    "shared_only": Row(
        "shared prompts only", store="shared_only", tokens="small_tokens", against="scale_small"
    ),
    "greedy_only": Row("greedy answers only", store="greedy_only", tokens="mid_tokens", against="scale_mid"),
    "ttt7": Row(
        "K = 7 TTT steps", overrides=("trainer.ttt_steps=7",), tokens="mid_tokens", against="scale_mid"
    ),
    # Every main head so far saw one store several times: what does a repeated token buy against a new one?
    "quarter_data": Row(
        "a quarter of the data, repeated",
        overrides=("trainer.train_fraction=0.25",),
        tokens="mid_tokens",
        against="scale_mid",
    ),
    # Two trainings at one seed give the same head to the last digit: how far does another training seed move τ?
    # The ablations' Δτ intervals (over prompts) leave that out.
    "seed_mid": Row(
        "another training seed (same data and validation split)",
        overrides=("trainer.seed=4",),
        tokens="mid_tokens",
        against="scale_mid",
    ),
    # The target is as sure of its answers to people's chat prompts as of those to its own prompts, yet the head
    # drafts the former far worse: a data gap (BENCHMARKS.md, "How sure the target is of its answers").
    "seeded": Row(
        "self-prompts written after examples of people's",
        store="seeded",
        tokens="mid_tokens",
        against="scale_mid",
    ),
    "people_x4": Row(
        "four answers to each of people's prompts",
        store="people_x4",
        tokens="mid_tokens",
        against="scale_mid",
    ),
    # Chat answers repeat the prompt's rare words (names, terms), which a small draft vocab cannot propose: 7.9%
    # of the target's chat answer tokens fall outside the 8192-token vocab, 2% of its code's (BENCHMARKS.md).
    "vocab16384": Row(
        "draft vocab 16384", overrides=("draft.vocab_size=16384",), tokens="mid_tokens", against="scale_mid"
    ),
}
CURVE = ("scale_small", "scale_mid", "main")  # the data-scaling rows: the same settings on more tokens


@dataclass
class Task:
    """One command's worth of work: done when its output exists; `needs` names the tasks it waits for."""

    name: str
    done: Callable[[], bool]
    run: Callable[[float | None], None]  # takes the deadline (time.time()), None: none
    needs: tuple[str, ...] = ()


class Scale:
    """The recipe's folders and commands for one set of options."""

    def __init__(self, opts: dict[str, str]):
        self.opts = opts
        self.out = (ROOT / opts["out"]).resolve()
        self.gpu = opts["gpu"]
        self.prompts = None if opts["eval_prompts"] == "all" else int(opts["eval_prompts"])

    def budget_end(self) -> float | None:
        """time.time() by which the whole recipe ends under `budget_s` (from its first start), None: no budget."""
        budget = float(self.opts["budget_s"])
        if budget <= 0:
            return None
        record = self.out / BUDGET_FILE
        if not record.is_file():
            self.out.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps({"started": time.time(), "budget_s": budget}))
        return json.loads(record.read_text())["started"] + budget

    def budgeted_length(self, run: Path, store: str) -> list[str]:
        """The main head's length under the budget, fixed when it first starts (<run>/budget.json) so that a resumed
        run keeps its schedule: as many steps as the time left allows, at most `main_epochs` epochs."""
        end = self.budget_end()
        if end is None:
            return []
        record = run / BUDGET_FILE
        if not record.is_file():
            seconds = end - time.time() - float(self.opts["eval_reserve_s"])
            if seconds <= 0:
                raise DeadlineReached("no time left in the budget to train the head")
            gbt = global_batch_tokens(self.opts)
            steps = int(seconds * float(self.opts["train_tokens_per_s"]) / gbt)
            manifest = json.loads((self.store_dir(store) / MANIFEST_FILE).read_text())
            epoch_steps = manifest["totals"]["tokens"] / gbt
            epochs = int(self.opts["main_epochs"])
            if steps >= epochs * epoch_steps:  # the epochs fit: they decide
                plan = {"seconds": round(seconds, 1), "steps": round(epochs * epoch_steps), "epochs": epochs,
                        "whole_epochs": True}  # fmt: skip
            else:
                plan = {"seconds": round(seconds, 1), "steps": max(1, steps), "epochs": round(steps / epoch_steps, 2),
                        "whole_epochs": False}  # fmt: skip
            run.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(plan))
        plan = json.loads(record.read_text())
        # The schedule spans what the time allows at the run's own measured rate (at most main_epochs epochs):
        # the planned steps above are an estimate for the report, not a length a slower or faster rate would miss.
        return [f"trainer.max_time_s={plan['seconds']}", "trainer.fit_steps_to_time=true"]

    def store_dir(self, store: str) -> Path:
        return self.out / "tokens" / store

    def run_dir(self, row: str) -> Path:
        return self.out / "rows" / row

    def store_overrides(self, store: str) -> list[str]:
        return [*STORES[store], f"extract.output_dir={self.store_dir(store)}"]

    def row_overrides(self, name: str) -> list[str]:
        """The row's data, its own overrides and its length (they win over `extra`)."""
        row = ROWS[name]
        steps = [] if row.tokens is None else [f"trainer.max_steps={self.steps(row.tokens)}"]
        return [*self.store_overrides(row.store), *self.own_overrides(name), *steps]

    def own_overrides(self, name: str) -> list[str]:
        """What the row changes against the experiment's settings; the main head's start when it continues one."""
        init = self.opts["main_init_from"]
        start = [f"trainer.init_from={Path(init).resolve()}"] if name == "main" and init else []
        return [*ROWS[name].overrides, *start]

    def common(self, overrides: list[str]) -> list[str]:
        return common_overrides(overrides, self.opts)

    def steps(self, tokens_option: str) -> int:
        """Optimizer steps in which the head sees the option's tokens once."""
        return max(1, round(int(self.opts[tokens_option]) / global_batch_tokens(self.opts)))

    def store_manifest(self, store: str) -> dict:
        """The store's manifest, {} before extraction wrote one."""
        manifest = self.store_dir(store) / MANIFEST_FILE
        return json.loads(manifest.read_text()) if manifest.is_file() else {}

    def store_totals(self, store: str) -> dict | None:
        """The store's totals (sequences, tokens, answer tokens) once it is complete, else None."""
        manifest = self.store_manifest(store)
        return manifest.get("totals") if manifest.get("status") == "complete" else None

    def store_done(self, store: str) -> bool:
        return self.store_manifest(store).get("status") == "complete"

    def extract(self, store: str, deadline: float | None) -> None:
        cmd = [sys.executable, "-u", "extract.py", *self.common(self.store_overrides(store))]
        sh(cmd, self.out / "logs" / f"data-{store}.log", self.gpu, deadline)

    def speculators_dir(self) -> Path:
        return self.out / "rows" / SPECULATORS

    def speculators_evaluated(self) -> bool:
        results = RunDir(self.run_dir(self.opts["speculators_row"])).results_file
        if not results.is_file():
            return False
        sets = json.loads(results.read_text())["sets"].values()
        return bool(sets) and all("baseline" in s["results"] for s in sets)

    def tasks(self, rows: list[str]) -> list[Task]:
        """Every command of the chosen rows, most important first."""
        tasks: list[Task] = []
        # The speculators head is evaluated beside its row's head, which that evaluation decodes too: the row's own
        # evaluation comes last (and is then done), so it runs only if the speculators head failed.
        beside = self.opts["speculators_row"] if SPECULATORS in rows else None
        deferred: list[Task] = []
        for name in rows:
            if name == SPECULATORS:
                tasks += self.speculators_tasks()
                continue
            store, run = ROWS[name].store, self.run_dir(name)
            if not any(t.name == f"data:{store}" for t in tasks):
                tasks.append(
                    Task(
                        f"data:{store}",
                        lambda s=store: self.store_done(s),
                        lambda d, s=store: self.extract(s, d),
                    )
                )
            common = self.common(self.row_overrides(name))
            epochs = int(self.opts["main_epochs"]) if ROWS[name].tokens is None else 1
            budgeted = name == "main"

            def train_row(deadline: float | None, r=run, c=common, e=epochs, b=budgeted, s=store) -> None:
                train(r, [*c, *(self.budgeted_length(r, s) if b else [])], e, self.gpu, deadline)

            tasks.append(
                Task(f"train:{name}", RunDir(run).report_file.is_file, train_row, (f"data:{store}",))
            )
            (deferred if name == beside else tasks).append(
                Task(
                    f"eval:{name}",
                    RunDir(run).results_file.is_file,
                    lambda d, r=run, c=common: evaluate(r, c, self.prompts, self.gpu, self.opts, d),
                    (f"train:{name}",),
                )  # fmt: skip
            )
        return tasks + deferred

    def speculators_tasks(self) -> list[Task]:
        """Train the speculators head on the data and steps of `speculators_row`, then evaluate it beside that
        row's head, on the same prompts in the same run (eval.baseline_draft)."""
        beside = self.opts["speculators_row"]
        save, run = self.speculators_dir(), self.run_dir(beside)
        row = ROWS[beside]
        epochs = int(self.opts["main_epochs"]) if row.tokens is None else 1

        def train_it(deadline: float | None) -> None:
            result = train_speculators(
                save, self.row_overrides(beside), epochs, self.gpu, self.opts, deadline
            )
            if "failed" in result:
                raise subprocess.CalledProcessError(1, f"side_by_side_speculators.py ({result['failed']})")

        def evaluate_it(deadline: float | None) -> None:
            baseline = (f"eval.baseline_draft={save / 'speculators'}",)
            evaluate(run, self.common(self.row_overrides(beside)), self.prompts, self.gpu, self.opts, deadline,
                     baseline)  # fmt: skip

        return [
            Task(
                f"train:{SPECULATORS}",
                (save / "speculators" / "config.json").is_file,
                train_it,
                (f"data:{row.store}",),
            ),  # fmt: skip
            Task(
                f"eval:{SPECULATORS}",
                self.speculators_evaluated,
                evaluate_it,
                (f"train:{SPECULATORS}", f"train:{beside}"),
            ),
        ]


def collect(scale: Scale, rows: list[str]) -> dict:
    """What exists so far: each store's totals, each row's training report and evaluation (per set and proposer)."""
    gbt = global_batch_tokens(scale.opts)
    stores: dict[str, dict | None] = {}
    for store in dict.fromkeys(ROWS[r].store for r in rows if r in ROWS):
        stores[store] = scale.store_totals(store)
    record: dict[str, dict] = {}
    for name in (r for r in rows if r in ROWS):
        row, run = ROWS[name], RunDir(scale.run_dir(name))
        entry = {"question": row.question, "store": row.store, "overrides": scale.own_overrides(name),
                 "against": row.against}  # fmt: skip
        if run.report_file.is_file():
            report = json.loads(run.report_file.read_text())
            entry |= {"steps": report["steps"], "tokens_seen": report["steps"] * gbt, "train_s": report["seconds"],
                      "tau_sim": report["tau_sim"]}  # fmt: skip
        if run.results_file.is_file():
            results = json.loads(run.results_file.read_text())
            entry |= {"sets": results["sets"], "num_spec_tokens": results.get("num_spec_tokens")}
        if (run.path / BUDGET_FILE).is_file():
            entry["budget"] = json.loads((run.path / BUDGET_FILE).read_text())
        record[name] = entry
    if SPECULATORS in rows:
        beside = scale.opts["speculators_row"]
        entry = {"question": f"the speculators package's head, {beside}'s data and steps", "store": ROWS[beside].store,
                 "overrides": ["trainer.lm_head_trainable=false"], "against": beside}  # fmt: skip
        if scale.speculators_evaluated():
            # Evaluated beside `beside`'s head: its results are that run's "baseline" proposer.
            entry["sets"] = {
                name: {**s, "results": {"eaglet": s["results"]["baseline"], "ngram": s["results"]["ngram"]}}
                for name, s in record[beside]["sets"].items()
            }
            entry |= {
                k: record[beside][k]
                for k in ("steps", "tokens_seen", "num_spec_tokens")
                if k in record[beside]
            }
        record[SPECULATORS] = entry
    return {"stores": stores, "rows": record}


def read_earlier(path: str) -> dict | None:
    """An earlier run's scale.json (`earlier`), read before any work starts so that a wrong path fails at once."""
    if not path:
        return None
    file = (ROOT / path).resolve()
    try:
        earlier = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(
            f"earlier={path}: cannot read it as a scale.json ({err}); give a recipe's scale.json"
        ) from err
    if not isinstance(earlier, dict) or not isinstance(earlier.get("rows"), dict) or "stores" not in earlier:
        raise SystemExit(
            f"earlier={path}: not a scale.json (it has no rows and stores); give a recipe's scale.json"
        )
    return earlier


def borrow_earlier(record: dict, earlier: dict, source: str, totals: Callable[[str], dict | None]) -> dict:
    """The record with the rows its ablations are measured against, and the data-scaling rows (CURVE), that this
    run lacks, taken from `earlier` where the store they trained on has the same totals here (`totals`) as there.
    A head trained on the same tokens at the same settings is the reference the ablation needs, and a point of the
    same curve, whichever run trained it."""
    rows = dict(record["rows"])
    wanted = {row["against"]: name for name, row in record["rows"].items() if row.get("against")}
    ran_on_curve = any(name in CURVE for name in record["rows"])
    for base in [*wanted, *(CURVE if ran_on_curve else ())]:
        if base in rows:
            continue
        found = earlier["rows"].get(base)
        if not found or not found.get("sets"):
            if base in wanted:
                print(
                    f"{wanted[base]}: {source} has no evaluated {base} row to measure it against", flush=True
                )
            continue
        if base not in wanted and not on_the_curve(found):
            continue  # a continued head there is no point of this curve
        here, there = totals(found["store"]), earlier["stores"].get(found["store"])
        if here is None or here != there:
            print(f"{wanted.get(base, 'data scaling')}: {base} of {source} is left out: its store {found['store']!r} holds {there} there and "
                  f"{here} here (the data differs; make it with the same seed and options)", flush=True)  # fmt: skip
            continue
        rows[base] = {**found, "earlier": Path(source).name}
    return {**record, "rows": rows}


def global_batch_tokens(opts: dict[str, str]) -> int:
    """trainer.global_batch_tokens as the commands see it: `extra`'s if it sets one, else the experiment's."""
    for arg in reversed(opts["extra"].split()):
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "trainer.global_batch_tokens":
            return int(value)
    experiment = OmegaConf.load(CONF_DIR / "experiments" / f"{opts['experiment']}.yaml")
    return int(experiment.trainer.global_batch_tokens)


def run_tasks(tasks: list[Task], deadline: float | None, min_start_s: float) -> dict[str, str]:
    """Each task in order, unless done or waiting for one not done; none starts within min_start_s of the deadline,
    and the one running at the deadline is stopped. Each task's status."""
    status: dict[str, str] = {}
    stopped = False
    for task in tasks:
        if task.done():
            status[task.name] = "done"
            continue
        waiting = [n for n in task.needs if status.get(n, "done") not in ("done", "done now")]
        if waiting:
            status[task.name] = f"left: waits for {', '.join(waiting)}"
        elif stopped or (deadline is not None and deadline - time.time() < min_start_s):
            stopped = True
            status[task.name] = "left: not started before the deadline"
        else:
            start = time.time()
            print(f"{task.name} ...", flush=True)
            try:
                task.run(deadline)
                status[task.name] = "done now"
            except DeadlineReached:
                stopped = True
                status[task.name] = "left: stopped at the deadline, continues where it was"
            except subprocess.CalledProcessError as err:
                status[task.name] = f"failed: exit {err.returncode}; see its log under <out>/"
            print(f"{task.name}: {status[task.name]} ({time.time() - start:.0f} s)", flush=True)
    return status


def main(argv: list[str]) -> int:
    opts = parse_options(argv, OPTS)
    rows = opts["rows"].split(",") if opts["rows"] else [*ROWS, SPECULATORS]
    unknown = [r for r in rows if r not in ROWS and r != SPECULATORS]
    if unknown or opts["speculators_row"] not in ROWS:
        raise SystemExit(
            f"unknown row {(unknown or [opts['speculators_row']])[0]!r}; rows: {', '.join([*ROWS, SPECULATORS])}"
        )
    if SPECULATORS in rows and opts["speculators_row"] not in rows:  # evaluated beside that row's head
        rows.insert(rows.index(SPECULATORS), opts["speculators_row"])
    earlier = read_earlier(opts["earlier"])
    scale = Scale(opts)
    start = time.time()
    ends = [start + float(opts["deadline_s"])] if float(opts["deadline_s"]) > 0 else []
    ends += [end] if (end := scale.budget_end()) is not None else []
    deadline = min(ends, default=None)
    status = run_tasks(scale.tasks(rows), deadline, float(opts["min_start_s"]))
    record = collect(scale, rows)
    if earlier is not None:
        record = borrow_earlier(record, earlier, opts["earlier"], scale.store_totals)
    scale.out.mkdir(parents=True, exist_ok=True)  # nothing may have started
    (scale.out / "scale.json").write_text(json.dumps({**record, "status": status}, indent=1))
    (scale.out / "scale.md").write_text(format_report(record, status))
    left = [name for name, s in status.items() if not s.startswith("done")]
    print(f"\n{time.time() - start:.0f} s; report: {scale.out / 'scale.md'}")
    for name, s in status.items():
        print(f"  {name}: {s}")
    if left:
        print(f"left: {', '.join(left)}; run the same command again to continue", flush=True)
    else:
        print("all done", flush=True)
    return 1 if any(s.startswith("failed") for s in status.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
