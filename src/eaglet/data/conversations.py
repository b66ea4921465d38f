"""Load chat conversations from JSONL files in the shared schema, validating every record.

Schema, one JSON object per line (blank lines are ignored, other keys are ignored)::

    {"id": "<unique str>", "conversations": [{"role": "user"|"assistant"|"system", "content": "<str>"}, ...]}
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglet.errors import ConfigError, DataError

ROLES = ("system", "user", "assistant")
_SCHEMA = '{"id": str, "conversations": [{"role": "user"|"assistant"|"system", "content": str}, ...]}'


@dataclass(frozen=True)
class Turn:
    role: str
    content: str


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]
    source: str  # file path it came from
    line: int  # 1-based line number in that file

    @property
    def where(self) -> str:
        """`file:line` of the record, for error messages."""
        return f"{self.source}:{self.line}"

    def has_assistant(self) -> bool:
        return any(turn.role == "assistant" for turn in self.turns)

    def to_json(self) -> dict[str, Any]:
        """The record in the shared JSONL schema."""
        return {
            "id": self.id,
            "conversations": [{"role": turn.role, "content": turn.content} for turn in self.turns],
        }


@dataclass
class LoadStats:
    records: int = 0  # non-blank lines read
    kept: int = 0
    skipped_no_assistant: int = 0
    empty_content_turns: int = 0  # turns with empty or whitespace-only content in kept records
    per_file: dict[str, int] = field(default_factory=dict)  # kept records per file
    hit_max_records: bool = False  # reading stopped early because max_records were kept


def read_jsonl_conversations(path: str | Path) -> Iterator[Conversation]:
    """Yield the conversations of one JSONL file in line order; raise DataError on the first bad line."""
    path = Path(path)
    _check_paths([path])
    with path.open("rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            if raw.strip():
                yield _parse_record(raw, str(path), line_no)


def load_conversations(
    paths: Sequence[str | Path],
    *,
    max_records: int | None = None,
    require_assistant: bool = True,
    strict: bool = False,
) -> tuple[list[Conversation], LoadStats]:
    """Load and validate conversations from `paths`, in file order.

    Conversations without an assistant turn are skipped and counted when `require_assistant` (an error
    when `strict`); `strict` also rejects empty content. `max_records` keeps the first N kept records.
    """
    files = _check_paths(paths)
    if max_records is not None and max_records < 1:
        raise ConfigError(f"max_records must be a positive integer or null, got {max_records}")

    stats = LoadStats(per_file={str(path): 0 for path in files})
    kept: list[Conversation] = []
    first_seen: dict[str, str] = {}
    for conversation in _read_all(files):
        stats.records += 1
        if conversation.id in first_seen:
            raise DataError(
                f"{conversation.where}: duplicate id {conversation.id!r}, first used at "
                f"{first_seen[conversation.id]}; ids must be unique across all dataset files "
                "(e.g. prefix them with the file name)"
            )
        first_seen[conversation.id] = conversation.where
        if require_assistant and not conversation.has_assistant():
            if strict:
                raise DataError(
                    f"{conversation.where}: conversation {conversation.id!r} has no assistant turn; drop it, "
                    "or set extract.strict=false to skip such records"
                )
            stats.skipped_no_assistant += 1
            continue
        empty = [i for i, turn in enumerate(conversation.turns) if not turn.content.strip()]
        if empty and strict:
            raise DataError(
                f"{conversation.where}: key 'conversations[{empty[0]}].content' is empty; "
                "fill in or drop the turn, or set extract.strict=false to keep it"
            )
        stats.empty_content_turns += len(empty)
        kept.append(conversation)
        stats.kept += 1
        stats.per_file[conversation.source] += 1
        if len(kept) == max_records:
            stats.hit_max_records = True
            break

    names = ", ".join(str(path) for path in files)
    if stats.records == 0:
        raise DataError(
            f"no records in {names}: the files are empty; point the dataset at non-empty JSONL files"
        )
    if not kept:
        raise DataError(
            f"none of the {stats.records} records in {names} has an assistant turn to learn from; set "
            "extract.regenerate.enabled=true to have the target write the answers (in Python: load prompt-only "
            "data with require_assistant=False)"
        )
    return kept, stats


def _check_paths(paths: Sequence[str | Path]) -> list[Path]:
    if not paths:
        raise ConfigError("no dataset files given; list at least one JSONL file in dataset.paths")
    files = [Path(path) for path in paths]
    folders = [str(path) for path in files if path.is_dir()]
    if folders:
        raise DataError(
            f"{', '.join(folders)} is a directory; dataset.paths lists JSONL files: name each file of it there"
        )
    missing = [str(path) for path in files if not path.is_file()]
    if missing:
        absent = sorted({str(Path(path).parent) for path in missing if not Path(path).parent.is_dir()})
        where = (
            f" (no folder {', '.join(absent)}: the shipped dataset configs read paths.shared_data, the first "
            "../shared/data found beside the project root, this checkout or the repository it was cloned from; "
            "set EAGLET_SHARED_DATA=/path/to/shared/data to point elsewhere)"
            if absent
            else ""
        )
        raise DataError(f"dataset file(s) not found: {', '.join(missing)}; check dataset.paths{where}")
    resolved = [path.resolve() for path in files]
    twice = sorted({str(path) for path in files if resolved.count(path.resolve()) > 1})
    if twice:
        raise ConfigError(
            f"dataset file(s) listed more than once: {', '.join(twice)}; list each file once in dataset.paths"
        )
    return files


def _read_all(files: list[Path]) -> Iterator[Conversation]:
    for path in files:
        yield from read_jsonl_conversations(path)


def _parse_record(raw: bytes, source: str, line: int) -> Conversation:
    where = f"{source}:{line}"
    try:
        # utf-8-sig: files saved by some Windows editors start with a byte-order mark.
        record = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        raise DataError(
            f"{where}: not valid UTF-8 ({err.reason} at byte {err.start}); re-save as UTF-8"
        ) from None
    except json.JSONDecodeError as err:
        raise DataError(
            f"{where}: not valid JSON ({err.msg} at column {err.colno}); each line must be one object {_SCHEMA}"
        ) from None
    if not isinstance(record, dict):
        raise DataError(
            f"{where}: expected a JSON object, got {_json_type(record)}; each line must be {_SCHEMA}"
        )

    for key in ("id", "conversations"):
        if key not in record:
            raise DataError(f"{where}: missing key {key!r}; each line must be {_SCHEMA}")
    conversation_id = record["id"]
    if not isinstance(conversation_id, str) or not conversation_id:
        raise DataError(
            f"{where}: key 'id' must be a non-empty string, got {_json_type(conversation_id)}; "
            "give every record a unique string id"
        )
    turns = record["conversations"]
    if not isinstance(turns, list) or not turns:
        got = "an empty list" if isinstance(turns, list) else _json_type(turns)
        raise DataError(f"{where}: key 'conversations' must be a non-empty list of turns, got {got}")
    return Conversation(
        id=conversation_id,
        turns=tuple(_parse_turn(turn, where, index) for index, turn in enumerate(turns)),
        source=source,
        line=line,
    )


def _parse_turn(turn: Any, where: str, index: int) -> Turn:
    key = f"conversations[{index}]"
    if not isinstance(turn, dict):
        raise DataError(
            f"{where}: key {key!r} must be an object with 'role' and 'content', got {_json_type(turn)}"
        )
    for name in ("role", "content"):
        if name not in turn:
            raise DataError(
                f"{where}: key {key!r} has no {name!r}; every turn needs string 'role' and 'content'"
            )
        if not isinstance(turn[name], str):
            raise DataError(f"{where}: key '{key}.{name}' must be a string, got {_json_type(turn[name])}")
    if turn["role"] not in ROLES:
        raise DataError(
            f"{where}: key '{key}.role' is {turn['role']!r}; allowed roles are {', '.join(ROLES)} "
            "(map others, e.g. ShareGPT 'human'/'gpt', to these)"
        )
    return Turn(role=turn["role"], content=turn["content"])


def _json_type(value: Any) -> str:
    if value == "":
        return "an empty string"
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number" if isinstance(value, int | float) else type(value).__name__)
