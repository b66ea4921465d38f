"""The regenerated-conversations JSONL that both regeneration paths (in-process, endpoint) write.

One record per finished conversation, in the shared schema plus a `prompt_hash` of the turns the target
answered; records are appended and fsynced, so a killed run loses at most the conversations in flight,
and a restart reuses every record whose prompts still match. A conversation that gained turns since its record
was written (a follow-up the target wrote, eaglet.data.follow_ups) goes on from the answers recorded.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import BinaryIO

from eaglet.data.conversations import Conversation, Turn
from eaglet.errors import DataError


def prompt_hash(conv: Conversation) -> str:
    """Hash of the turns the target answers: an edited prompt file is regenerated, not silently reused."""
    prompts = [[t.role, t.content] for t in conv.turns if t.role != "assistant"]
    return hashlib.sha256(json.dumps(prompts, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def user_turn_groups(conv: Conversation) -> list[list[Turn]]:
    """The non-assistant turns between assistant turns: each group ends with the user turn to answer."""
    groups: list[list[Turn]] = []
    current: list[Turn] = []
    for turn in conv.turns:
        if turn.role == "assistant":
            continue
        current.append(turn)
        if turn.role == "user":
            groups.append(current)
            current = []
    return groups


def kept_turns(history: Sequence[Turn], groups: Sequence[Sequence[Turn]]) -> tuple[Turn, ...]:
    """The turns a regenerated record keeps: those answered so far. A conversation whose first prompt left no
    room for an answer keeps that prompt unanswered, so the file stays a valid dataset (readers skip and
    count a conversation without an assistant turn)."""
    if history:
        return tuple(history)
    return tuple(groups[0]) if groups else ()


def answered_prefixes(path: Path, pending: Sequence[Conversation]) -> dict[str, list[Turn]]:
    """For each of `pending` (not in `path` as it is), the longest run of its leading turns that a record with its
    id answered: its prompt turns up to some user turn, each followed by the answer the record holds.

    Call it after read_finished, which cuts a torn last line. Regeneration goes on from there. An answer depends only on the turns before it and a seed of its
    conversation and turn, so going on gives what answering every turn again would, without the cost (and an
    answer the target's later turns were written after stays exactly as it was).
    """
    if not path.exists() or not pending:
        return {}
    wanted = {c.id: user_turn_groups(c) for c in pending}
    prefixes: dict[str, list[Turn]] = {}
    for raw in path.read_bytes().splitlines():
        record = json.loads(raw)
        groups = wanted.get(record["id"])
        if groups is None:
            continue
        turns = [Turn(t["role"], t["content"]) for t in record["conversations"]]
        prefix = _answered_prefix(turns, groups)
        if len(prefix) >= len(prefixes.get(record["id"], ())) and prefix:
            prefixes[record["id"]] = prefix
    return prefixes


def _answered_prefix(turns: Sequence[Turn], groups: Sequence[Sequence[Turn]]) -> list[Turn]:
    """The leading turns of a record that answer `groups` in order: each group verbatim, then one answer."""
    prefix: list[Turn] = []
    at = 0
    for group in groups:
        end = at + len(group)
        if list(turns[at:end]) != list(group) or end >= len(turns) or turns[end].role != "assistant":
            break
        prefix.extend(turns[at : end + 1])
        at = end + 1
    return prefix


def append_finished(sink: BinaryIO, finished: Iterable[tuple[Conversation, Conversation]]) -> None:
    """Append (source, regenerated) pairs as records and fsync: once this returns they survive a kill.

    A write that fails (a full disk) is cut off again; a kill may leave a partial record, which read_finished cuts.
    """
    payload = b"".join(_record_line(source, regenerated) for source, regenerated in finished)
    sink.flush()
    fd = sink.fileno()
    # Written past the buffer: a buffered writer would retry what failed when closed, after the cut.
    end = os.fstat(fd).st_size
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.ftruncate(fd, end)
        raise


def _record_line(source: Conversation, regenerated: Conversation) -> bytes:
    record = {**regenerated.to_json(), "prompt_hash": prompt_hash(source)}
    return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")


def read_finished(path: Path, wanted: dict[str, str]) -> dict[str, Conversation]:
    """Conversations already regenerated in `path` whose prompts still match `wanted` (id -> prompt hash).

    A torn last line from a killed run is cut off.
    """
    if not path.exists():
        return {}
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with open(path, "r+b") as fh:
            fh.truncate(len(complete))
    return _parse_records(complete, path, wanted, "delete the file to regenerate from scratch")


def import_finished(source: Path, out_path: Path, conversations: Sequence[Conversation]) -> int:
    """Copy the records of `source` (a regenerated JSONL, gzipped or not, e.g. from a GPU machine) that answer
    `conversations` and are not in `out_path` yet into `out_path`; how many were copied.

    Matching is by conversation id and prompt hash, so an edited prompt is regenerated, never reused.
    """
    if not source.is_file():
        raise DataError(
            f"extract.regenerate.import_from={str(source)!r} is not a file; pass a regenerated JSONL "
            "(data/regenerated/<model>-<key>.jsonl, gzipped or not) or null"
        )
    wanted = {c.id: prompt_hash(c) for c in conversations}
    have = read_finished(out_path, wanted)
    opener = gzip.open if source.suffix == ".gz" else open
    try:
        with opener(source, "rb") as fh:
            data = fh.read()
    except (OSError, EOFError) as exc:  # a truncated or corrupt gzip file
        raise DataError(f"{source}: cannot read ({exc}); copy the file again") from exc
    found = _parse_records(data, source, wanted, "fix or replace the file, or set import_from=null")
    new = {conv_id: conv for conv_id, conv in found.items() if conv_id not in have}
    if not new:
        return 0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    sources = {c.id: c for c in conversations}
    with open(out_path, "ab") as sink:
        append_finished(sink, ((sources[conv_id], conv) for conv_id, conv in new.items()))
    return len(new)


def _parse_records(data: bytes, path: Path, wanted: dict[str, str], fix: str) -> dict[str, Conversation]:
    done: dict[str, Conversation] = {}
    for number, raw in enumerate(data.splitlines(), start=1):
        try:
            record = json.loads(raw)
            conv_id = record["id"]
            turns = tuple(Turn(t["role"], t["content"]) for t in record["conversations"])
            recorded_hash = record["prompt_hash"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DataError(f"{path}:{number}: unreadable regenerated conversation ({exc}); {fix}") from exc
        if wanted.get(conv_id) == recorded_hash:
            done[conv_id] = Conversation(id=conv_id, turns=turns, source=str(path), line=number)
    return done
