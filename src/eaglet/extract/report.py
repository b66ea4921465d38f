"""The printed summary of an extraction run."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from eaglet.extract.core import ExtractSummary
from eaglet.fsutil import human_bytes


def print_summary(summary: ExtractSummary, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"extraction: {summary.output_dir}", show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")
    rows = [
        ("sequences", f"{summary.sequences:,}"),
        ("tokens", f"{summary.tokens:,}"),
        (
            "loss-masked tokens",
            f"{summary.masked_tokens:,} ({summary.masked_tokens / max(summary.tokens, 1):.0%})",
        ),
        ("truncated / skipped (no assistant token)", f"{summary.truncated:,} / {summary.skipped:,}"),
        ("shards (resumed)", f"{summary.shards} ({summary.resumed_shards})"),
        (
            "shard bytes written",
            f"{human_bytes(summary.bytes_on_disk)} ({summary.bytes_on_disk / max(summary.tokens, 1):,.0f} B/token)",
        ),
        ("extraction", f"{summary.seconds:.1f} s, {summary.tokens_per_second:,.0f} tokens/s"),
    ]
    rg = summary.regenerate
    if rg is not None:
        rows.append(
            (
                "regeneration",
                f"{rg.generated_turns:,} turns, {rg.generated_tokens:,} tokens in {rg.seconds:.1f} s "
                f"({rg.resumed} conversations resumed, {rg.cut_for_length} cut for length"
                + (f", {rg.reused_turns:,} earlier answers reused" if rg.reused_turns else "")
                + ")",
            )
        )
    follow_ups = summary.follow_ups
    if follow_ups is not None:
        by_turns = ", ".join(f"{turns}: {n:,}" for turns, n in follow_ups["user_turns"].items())
        rows.append(
            (
                "self-prompted follow-ups",
                f"{follow_ups['written']:,} turns written, {sum(follow_ups['dropped'].values()):,} dropped; "
                f"conversations by user turns {by_turns}",
            )
        )
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
