"""The printed plan: data, time and disk side by side per hardware, serving speedups, assumptions, verdict."""

from __future__ import annotations

import math

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from eaglet.plan.acceptance import AcceptanceCurve
from eaglet.plan.data_size import DataSize
from eaglet.plan.modes import gb
from eaglet.plan.planner import HardwarePlan, PlannedRun
from eaglet.plan.quality import QualityFit
from eaglet.plan.serving import pcie_allreduce_fixed_seconds
from eaglet.plan.target_cost import dense_bits, stored_weight_bytes
from eaglet.plan.training import calibrated_efficiency
from eaglet.target_model.footprint import TARGET_MEMORY_SHARE


def _hours(seconds: float) -> str:
    if seconds >= 360:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 60:,.1f} min" if seconds >= 60 else f"{seconds:,.1f} s"


def _gpu_hours(p: HardwarePlan) -> str:
    return f"{p.gpu_hours:,.0f} GPU-hours" if p.gpu_hours >= 10 else f"{p.gpu_hours:,.2f} GPU-hours"


def _tb(n: float) -> str:
    return f"{n / 1e12:,.2f} TB" if n >= 1e11 else f"{n / 1e9:,.2f} GB"


def _rate(tokens_per_second: float) -> str:
    return (
        f"{tokens_per_second / 1e3:,.1f}K tok/s"
        if tokens_per_second >= 1e3
        else f"{tokens_per_second:,.0f} tok/s"
    )


def verdict(plans: list[HardwarePlan], deadline_hours: float) -> str:
    """One line: which hardware finishes the configured run within the deadline, and at what GPU-hours."""
    feasible = [p for p in plans if p.feasible]
    within = sorted((p for p in feasible if p.seconds <= deadline_hours * 3600), key=lambda p: p.gpu_hours)

    def describe(p: HardwarePlan) -> str:
        mode = f", trainer.features={p.choice.mode}" if p.choice.mode else ""
        return f"{p.hardware.name} ({_hours(p.seconds)}, {_gpu_hours(p)}{mode})"

    others = [p for p in feasible if p not in within]
    blocked = [f"{p.hardware.name} cannot ({p.problems[0]})" for p in plans if not p.feasible]
    if within:
        line = f"Under {deadline_hours:g} h: " + ", ".join(describe(p) for p in within)
        if others:
            line += "; over: " + ", ".join(describe(p) for p in others)
    elif others:
        fastest = min(others, key=lambda p: p.seconds)
        line = f"None finishes under {deadline_hours:g} h; fastest: {describe(fastest)}"
    else:
        line = "No hardware can run this plan"
    return line + ("; " + "; ".join(blocked) if blocked else "") + "."


def data_table(run: PlannedRun, data: DataSize) -> Table:
    model, draft, trainer = run.model, run.draft, run.trainer
    bits = f"{model.weight_bits}-bit" + (
        f" experts, {dense_bits(model)}-bit rest"
        if model.num_experts and dense_bits(model) != model.weight_bits
        else ""
    )
    table = Table(title="model and data", show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")
    experts = (
        f", MoE {model.num_experts} experts, top-{model.num_experts_per_tok}"
        if model.num_experts
        else ", dense"
    )
    rows = [
        (
            "target",
            f"{model.name}: {model.total_params_b:g}B total, {model.active_params_b:g}B active, {bits}{experts}; "
            f"{stored_weight_bytes(model) / 1e9:,.0f} GB of weights",
        ),
        (
            "draft head",
            f"H {draft.hidden_size}, {draft.num_attention_heads} heads, MLP {draft.intermediate_size}, "
            f"draft vocab {draft.vocab_size:,}, K = {trainer.ttt_steps} TTT steps, "
            f"lm_head {'trainable' if trainer.lm_head_trainable else 'frozen'}",
        ),
        ("conversations", f"{data.conversations:,}"),
        ("tokens", f"{data.tokens:,.0f} ({data.loss_fraction:.0%} in the loss mask)"),
        (
            "regenerated",
            f"{data.generated_tokens:,.0f} tokens generated after {data.prefill_tokens:,.0f} prompt tokens"
            if run.regenerate
            else "off (extract.regenerate.enabled=false)",
        ),
        ("mean causal context", f"{data.mean_context:,.0f} tokens"),
        ("sized from", escape(data.source)),  # (it may quote an override like dataset.paths=[...])
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def time_table(run: PlannedRun, plans: list[HardwarePlan]) -> Table:
    table = Table(title=f"time and disk ({run.trainer.max_epochs} epoch(s))")
    table.add_column("", no_wrap=True)
    for p in plans:
        table.add_column(p.hardware.name, overflow="fold")

    def row(label: str, cell) -> None:
        table.add_row(label, *(cell(p) for p in plans))

    def link(p: HardwarePlan) -> str:
        hw = p.hardware
        nodes = f" × {hw.num_nodes} nodes" if hw.num_nodes > 1 else ""
        return f"{hw.devices} × {hw.gpu}{nodes}, {hw.interconnect} {hw.interconnect_bandwidth_gbs:g} GB/s"

    def placement(p: HardwarePlan) -> str:
        if p.placement.group is None:
            return "[red]does not fit[/red]"
        return f"TP{p.placement.group} × {p.placement.replicas} replica(s)"

    def regeneration(p: HardwarePlan) -> str:
        r = p.regeneration
        if r is None:
            return "—"
        return (
            f"{_hours(r.seconds)} (decode steps {_rate(r.step_tokens_per_second)}, the loop at "
            f"{r.loop_efficiency:.0%} of them; batch {r.batch}/replica)"
        )

    def extraction(p: HardwarePlan) -> str:
        e = p.extraction
        if e is None:
            return "—"
        disk = f"; disk {e.disk_write_gbs:g} GB/s assumed" if e.disk_assumed else ""
        return (
            f"{_hours(p.extraction_seconds)} ({_rate(e.tokens_per_second)}; most time: {e.bottleneck}{disk})"
        )

    def training(p: HardwarePlan) -> str:
        t = p.training
        comm = (
            " (gradient all-reduce bound)"
            if t.allreduce_seconds_per_step > t.compute_seconds_per_step
            else ""
        )
        return f"{_hours(t.seconds_per_epoch)} ({_rate(t.tokens_per_second)}){comm}"

    def total(p: HardwarePlan) -> str:
        text = f"{_hours(p.seconds)}, {_gpu_hours(p)}" + (f" ({p.choice.mode})" if p.choice.mode else "")
        return text if p.feasible else f"[red]{text}; blocked[/red]"

    row("devices", link)
    row("target placement", placement)
    row("regeneration", regeneration)
    row("extraction", extraction)
    row("training per epoch", training)
    row("total", total)
    for i, dtype in enumerate(run.plan.dtypes):

        def disk(p: HardwarePlan, i: int = i) -> str:
            d = p.disk[i]
            mark = {None: "disk size unknown", True: "fits", False: "[red]does not fit[/red]"}[d.fits]
            return (
                f"{_tb(d.total_bytes)} ({d.bytes_per_token:,} B/token) of {p.hardware.disk_tb:g} TB: {mark}"
            )

        row(f"disk, {dtype} shards", disk)
    return table


MODE_LABELS = {
    "shards": "shards (extract, then train)",
    "online": "online (the target in each step)",
    "window": "window (extract.max_disk_gb, side by side)",
}


def modes_table(run: PlannedRun, plans: list[HardwarePlan]) -> Table:
    """Disk and time of each way to train (eaglet.plan.modes), and the one to use on each machine."""
    table = Table(
        title=f"ways to train: the most disk the data takes at once, and the time ({run.trainer.max_epochs} epoch(s))"
    )
    table.add_column("trainer.features", no_wrap=True)
    for p in plans:
        table.add_column(p.hardware.name, overflow="fold")
    for mode, label in MODE_LABELS.items():

        def cell(p: HardwarePlan, mode: str = mode) -> str:
            m = next(m for m in p.modes if m.mode == mode)
            bound = f" (extract.max_disk_gb={gb(m.max_disk_gb)})" if m.max_disk_gb is not None else ""
            text = f"{_tb(m.disk_bytes)}{bound}, {_hours(m.seconds)}"
            return text if m.feasible else f"[red]{m.problem}[/red]"

        table.add_row(label, *(cell(p) for p in plans))
    table.add_section()
    table.add_row(
        "use",
        *(
            f"[bold]{p.choice.mode}[/bold]: {p.choice.reason}" if p.choice.mode else "[red]none[/red]"
            for p in plans
        ),
    )
    return table


def serving_table(plans: list[HardwarePlan], curve: AcceptanceCurve, run: PlannedRun) -> Table:
    s, model = run.plan.serving, run.model
    table = Table(
        title="predicted serving speedup over plain decoding",
        caption=f"batch {s.batch_size}, context {s.context_tokens:,} tokens; acceptance {curve.source}",
    )
    table.add_column("draft length K")
    table.add_column("τ(K)")
    shown = [p for p in plans if p.serving]
    for p in shown:
        table.add_column(p.hardware.name)
    for k in range(1, s.max_draft_length + 1):
        table.add_row(str(k), f"{curve.tau(k):.2f}", *(f"{p.serving[k - 1].speedup:.2f}×" for p in shown))
    if shown:
        table.add_section()
        plain = [p.serving[0].plain for p in shown]
        table.add_row("plain decode", "", *(f"{c.seconds * 1e3:.2f} ms/step" for c in plain))
        table.add_row("all-reduce share", "", *(f"{c.allreduce / c.seconds:.0%}" for c in plain))
        if model.num_experts:
            best = [max(p.serving, key=lambda point: point.speedup) for p in shown]
            table.add_row(
                "experts/layer at best K",
                "",
                *(f"{b.distinct_experts:.1f} of {model.num_experts} (K={b.draft_length})" for b in best),
            )
    missing = [p.hardware.name for p in plans if not p.serving]
    if missing:
        table.caption += f"; not shown: {', '.join(missing)} (the target does not fit one serving group)"
    return table


def assumptions_table(run: PlannedRun, plans: list[HardwarePlan]) -> Table:
    cal, plan, trainer = run.plan.calibration, run.plan, run.trainer
    table = Table(title="assumptions (conf/plan/default.yaml; override any plan.* key)", show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")
    rows = [
        (
            "target forward",
            "2 × active parameters per token + attention; replicas of the smallest TP group that holds it",
        ),
        (
            "training",
            f"{calibrated_efficiency(cal, trainer):.1%} of datasheet bf16 for the "
            f"{'compiled' if trainer.compile else 'eager'} layer (trainer.compile; calibrated on the H200 "
            f"side-by-side row, Llama-3.1-8B shapes, K=3, lm_head frozen), + the loss's element-wise passes over "
            f"the draft vocab at {cal.training_bandwidth_efficiency:.0%} of datasheet bandwidth; attention per "
            f"{cal.training_attention} on GPUs, only at trained positions; + per TTT step on GPUs "
            f"{cal.training_token_step_us:g} µs a token and {cal.training_microbatch_step_ms:g} ms a micro-batch "
            f"(small kernels, calibrated on the H100 SmolLM2-head rows); DDP gradient all-reduce overlapped",
        ),
        (
            "extraction",
            f"forward at {cal.prefill_efficiency:.1%} of datasheet bf16; storing beside it at the slower of "
            f"{cal.host_store_gbs:g} GB/s per replica and the disk ({cal.disk_write_gbs:g} GB/s where the hardware "
            f"gives none), the forward waiting for {cal.store_exposed_share:.0%} of the storing time (H200 "
            "extraction rows)",
        ),
        (
            "decode",
            f"{cal.decode_bandwidth_efficiency:.1%} of datasheet bandwidth (the H200 decode-step row), "
            f"{cal.decode_compute_efficiency:.0%} of bf16 (assumed); verification reads each distinct expert "
            "E·(1−(1−k/E)^n)",
        ),
        (
            "all-reduce",
            f"PCIe {pcie_allreduce_fixed_seconds(cal) * 1e6:.1f} µs each (solved from {cal.pcie_allreduce_share:.1%} "
            f"of decode: {cal.pcie_allreduce_model} on {cal.pcie_allreduce_hardware}), NVLink "
            f"{cal.nvlink_allreduce_us:g} µs, + bytes / link bandwidth; 2 per layer",
        ),
        ("weights in memory", f"at most {plan.weight_memory_fraction:.0%} of device memory"),
        (
            "ways to train",
            "shards: the whole folder on disk, the target's forward once; online: 5 B a token on disk, the target "
            f"(bf16, at most {TARGET_MEMORY_SHARE:.0%} of one device) forward every epoch on each device; window: "
            "the head, token counts and window + validation + 1 shards at least, extraction and training taking "
            "turns on the same devices (time as shards)",
        ),
        (
            "regeneration",
            f"{plan.regenerate_batch_size} sequences per replica (fewer if the KV cache does not fit); the loop at "
            f"{cal.regeneration_loop_efficiency:.1%} of its decode steps' rate (the scale recipe's answers on one H200, a 135M target)",
        ),
        (
            "tokens from text",
            f"{plan.chars_per_token:g} characters per token + {plan.template_tokens_per_turn} per turn",
        ),
    ]
    if any(p.hardware.num_nodes > 1 for p in plans):
        rows.append(("multi-node", "links between nodes are taken at the in-node link rate (optimistic)"))
    for key, value in rows:
        table.add_row(key, value)
    return table


def format_tokens(n: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:,.3g}{suffix}"
    return f"{n:,.0f}"


def quality_table(
    quality: QualityFit, data: DataSize, plans: list[HardwarePlan], features: str = "shards"
) -> Table:
    """Per evaluation set: τ along the fitted line at this plan's tokens, and what a goal τ takes."""
    k = quality.num_spec_tokens
    planned = data.tokens * plans[0].training.epochs
    table = Table(
        title=(
            f"What more training buys (τ{f' at K={k}' if k is not None else ''} against log2 of tokens trained, "
            f"{len(quality.heads)} measured heads)"
        ),
        caption=(
            f"this plan trains on {format_tokens(planned)} tokens ({data.tokens:,.0f} × {plans[0].training.epochs} "
            "epoch(s)); the line extrapolates past the measured range, and it holds for the measured target "
            "and data only"
        ),
    )
    for column in (
        "set",
        "heads",
        "τ measured",
        "+τ per doubling",
        "τ at this plan's tokens",
        f"goal τ ({quality.goal_ratio:g} × {quality.baseline})",
        "tokens to the goal",
    ):
        table.add_column(column, overflow="fold")
    measured_rate = quality.measured_tokens_per_s
    if measured_rate:
        table.add_column(f"time to the goal at the heads' own rate ({_rate(measured_rate)})", overflow="fold")
    for p in plans:
        table.add_column(f"time to the goal, {p.hardware.name} ({features}, estimated)", overflow="fold")
    # The heads' own rate first: measured on their machine, it needs no model of the step. Then the planner's,
    # training the way the run is configured to (trainer.features: online adds the target's forward).
    estimated = [next(m.train_tokens_per_second for m in p.modes if m.mode == features) for p in plans]
    rates = ([measured_rate] if measured_rate else []) + estimated
    for fit in quality.fits:
        goal = quality.goal_ratio * fit.baseline_tau
        if math.isnan(goal):  # no baseline measured on this set
            goal_text, needed_text, times = f"no {quality.baseline} τ", "—", ["—"] * len(rates)
        else:
            needed = fit.tokens_for(goal)
            goal_text = f"{goal:.2f} ({quality.baseline} {fit.baseline_tau:.2f})"
            if needed is None:
                needed_text, times = "never on this line", ["never on this line"] * len(rates)
            else:
                needed_text = format_tokens(needed)
                times = ["met" if needed <= planned else _hours(needed / rate) for rate in rates]
        table.add_row(
            fit.name,
            str(fit.points),
            f"{fit.tau_min:.2f}-{fit.tau_max:.2f}",
            f"{fit.slope_per_doubling:+.3f}",
            f"{fit.tau_at(planned):.2f}",
            goal_text,
            needed_text,
            *times,
        )
    for name in quality.unfitted:
        taus = [h.tau[name] for h in quality.heads if name in h.tau]
        measured = f"{min(taus):.2f}-{max(taus):.2f}"
        table.add_row(name, str(len(taus)), measured, "needs two token counts", *[""] * (3 + len(rates)))
    return table


def print_plan(
    run: PlannedRun,
    data: DataSize,
    curve: AcceptanceCurve,
    plans: list[HardwarePlan],
    console: Console | None = None,
    quality: QualityFit | None = None,
) -> str:
    console = console or Console(width=160)
    console.print(data_table(run, data))
    console.print(time_table(run, plans))
    console.print(modes_table(run, plans))
    console.print(serving_table(plans, curve, run))
    if quality is not None:
        console.print(quality_table(quality, data, plans, str(run.trainer.features)))
    console.print(assumptions_table(run, plans))
    line = verdict(plans, run.plan.deadline_hours)
    console.print(f"[bold]{line}[/bold]")
    return line
