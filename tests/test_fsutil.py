"""Append-only JSONL records: what a kill leaves behind, and text that str.splitlines() would cut."""

from __future__ import annotations

from pathlib import Path

import pytest

from eaglet.errors import DataError
from eaglet.fsutil import append_jsonl, read_appended_jsonl

# Characters str.splitlines() takes for line ends that json.dumps(ensure_ascii=False) writes unescaped.
ODD_LINE_ENDS = "a\u2028b\u2029c\x85d\x0be\x0cf\x1cg\x1dh\x1ei"


def test_records_round_trip_with_characters_that_splitlines_would_break_on(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    records = [{"id": 0, "text": ODD_LINE_ENDS}, {"id": 1, "text": "plain\nnewline"}, {"id": 2, "text": ""}]
    with open(path, "ab") as sink:
        append_jsonl(sink, records[:2])
        append_jsonl(sink, records[2:])
    assert read_appended_jsonl(path) == records


def test_a_line_cut_by_a_kill_is_dropped_and_the_next_append_starts_clean(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    with open(path, "ab") as sink:
        append_jsonl(sink, [{"id": 0}])
    path.write_bytes(path.read_bytes() + b'{"id": 1, "te')  # a write cut short
    assert read_appended_jsonl(path) == [{"id": 0}]
    assert path.read_bytes() == b'{"id": 0}\n'
    with open(path, "ab") as sink:
        append_jsonl(sink, [{"id": 2}])
    assert read_appended_jsonl(path) == [{"id": 0}, {"id": 2}]


def test_a_missing_file_holds_no_records(tmp_path: Path) -> None:
    assert read_appended_jsonl(tmp_path / "none.jsonl") == []


def test_a_damaged_complete_line_is_an_error_that_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    path.write_bytes(b'{"id": 0}\n{"id": 1, oops}\n{"id": 2}\n')
    with pytest.raises(DataError, match=r"records\.jsonl, line 2: not a JSON record.*delete it"):
        read_appended_jsonl(path)
