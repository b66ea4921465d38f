"""Loading and validating JSONL conversations."""

import functools
import json
from collections import Counter
from pathlib import Path

import pytest

from eaglet.config import shared_data_dir
from eaglet.config.schema import DatasetConfig, EvalSetConfig
from eaglet.data.conversations import Conversation, Turn, load_conversations, read_jsonl_conversations
from eaglet.data.dataset import load_dataset
from eaglet.errors import ConfigError, DataError

OASST = shared_data_dir() / "oasst_en100.jsonl"


def record(cid: str, *roles: str) -> dict:
    return {"id": cid, "conversations": [{"role": role, "content": f"{role} text"} for role in roles]}


def write_jsonl(path: Path, *lines: object) -> Path:
    """Write `lines` (dicts are JSON-encoded, strings written verbatim) one per line."""
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    path.write_text(text + "\n", encoding="utf-8")
    return path


def test_reads_turns_and_locations(tmp_path):
    path = write_jsonl(
        tmp_path / "a.jsonl", record("a-0", "system", "user", "assistant"), "", record("a-1", "user")
    )
    conversations = list(read_jsonl_conversations(path))
    assert [c.id for c in conversations] == ["a-0", "a-1"]
    assert conversations[0].turns == (
        Turn("system", "system text"),
        Turn("user", "user text"),
        Turn("assistant", "assistant text"),
    )
    assert [c.line for c in conversations] == [1, 3]  # the blank line 2 is skipped but still counted
    assert conversations[1].source == str(path)
    assert conversations[0].has_assistant() and not conversations[1].has_assistant()
    assert conversations[0].to_json() == record("a-0", "system", "user", "assistant")


BAD_LINES = [
    ('{"id": "x", "conversations": [', "not valid JSON"),
    ('["a", "b"]', "expected a JSON object, got an array"),
    ('{"conversations": [{"role": "user", "content": "q"}]}', "missing key 'id'"),
    ('{"id": 7, "conversations": [{"role": "user", "content": "q"}]}', "key 'id' must be a non-empty string"),
    ('{"id": "", "conversations": [{"role": "user", "content": "q"}]}', "got an empty string"),
    ('{"id": "x"}', "missing key 'conversations'"),
    ('{"id": "x", "conversations": {"role": "user"}}', "'conversations' must be a non-empty list"),
    ('{"id": "x", "conversations": []}', "got an empty list"),
    ('{"id": "x", "conversations": ["hello"]}', "key 'conversations[0]' must be an object"),
    ('{"id": "x", "conversations": [{"content": "q"}]}', "key 'conversations[0]' has no 'role'"),
    ('{"id": "x", "conversations": [{"role": "user"}]}', "key 'conversations[0]' has no 'content'"),
    (
        '{"id": "x", "conversations": [{"role": "user", "content": 3}]}',
        "'conversations[0].content' must be a string",
    ),
    (
        '{"id": "x", "conversations": [{"role": null, "content": "q"}]}',
        "'conversations[0].role' must be a string",
    ),
]


@pytest.mark.parametrize(("bad_line", "expected"), BAD_LINES)
def test_bad_record_names_file_and_line(tmp_path, bad_line, expected):
    path = write_jsonl(tmp_path / "bad.jsonl", record("ok-0", "user", "assistant"), "", bad_line)
    with pytest.raises(DataError) as info:
        load_conversations([path])
    message = str(info.value)
    assert f"{path}:3" in message
    assert expected in message


def test_unknown_role_lists_allowed_roles(tmp_path):
    path = write_jsonl(tmp_path / "roles.jsonl", record("r-0", "user", "gpt"))
    with pytest.raises(DataError, match=r"roles.jsonl:1: key 'conversations\[1\].role' is 'gpt'") as info:
        load_conversations([path])
    assert "system, user, assistant" in str(info.value)


def test_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(record("u-0", "user", "assistant")).encode() + b'\n{"id": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not valid UTF-8"):
        load_conversations([path])


def test_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(record("b-0", "user", "assistant")).encode() + b"\n")
    conversations, _ = load_conversations([path])
    assert conversations[0].id == "b-0"


def test_missing_file(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", record("g-0", "user", "assistant"))
    with pytest.raises(DataError, match="not found") as info:
        load_conversations([good, tmp_path / "nope.jsonl"])
    assert "nope.jsonl" in str(info.value)
    with pytest.raises(DataError, match="nope.jsonl"):
        list(read_jsonl_conversations(tmp_path / "nope.jsonl"))


def test_a_directory_is_named_a_directory(tmp_path):
    folder = tmp_path / "chats"
    folder.mkdir()
    with pytest.raises(DataError, match=r"chats is a directory.*dataset\.paths") as info:
        load_conversations([folder])
    assert "not found" not in str(info.value)
    with pytest.raises(DataError, match="is a directory"):
        list(read_jsonl_conversations(folder))


def test_bad_arguments(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", record("a-0", "user", "assistant"))
    with pytest.raises(ConfigError, match="no dataset files"):
        load_conversations([])
    with pytest.raises(ConfigError, match="max_records"):
        load_conversations([path], max_records=0)
    with pytest.raises(ConfigError, match="more than once"):
        load_conversations([path, str(path)])


def test_duplicate_id_across_files_names_both_places(tmp_path):
    first = write_jsonl(
        tmp_path / "first.jsonl", record("a", "user", "assistant"), record("dup", "user", "assistant")
    )
    second = write_jsonl(
        tmp_path / "second.jsonl", record("b", "user", "assistant"), record("dup", "user", "assistant")
    )
    with pytest.raises(DataError, match="duplicate id 'dup'") as info:
        load_conversations([first, second])
    message = str(info.value)
    assert f"{second}:2" in message and f"{first}:2" in message


def test_empty_dataset_names_the_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    blank = write_jsonl(tmp_path / "blank.jsonl", "", "   ")
    with pytest.raises(DataError, match="no records") as info:
        load_conversations([empty, blank])
    assert str(empty) in str(info.value) and str(blank) in str(info.value)


def test_no_assistant_is_skipped_and_counted(tmp_path):
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        record("m-0", "user", "assistant"),
        record("m-1", "user"),
        record("m-2", "system", "user", "assistant", "user"),
        record("m-3", "system", "user"),
    )
    conversations, stats = load_conversations([path])
    assert [c.id for c in conversations] == ["m-0", "m-2"]
    assert (stats.records, stats.kept, stats.skipped_no_assistant) == (4, 2, 2)
    assert stats.per_file == {str(path): 2}

    everything, stats = load_conversations([path], require_assistant=False)
    assert len(everything) == 4 and stats.skipped_no_assistant == 0

    with pytest.raises(DataError, match=r"mixed.jsonl:2: conversation 'm-1' has no assistant turn"):
        load_conversations([path], strict=True)


def test_prompt_only_data_needs_require_assistant_false(tmp_path):
    path = write_jsonl(tmp_path / "prompts.jsonl", record("p-0", "user"), record("p-1", "user"))
    with pytest.raises(DataError, match="require_assistant=False"):
        load_conversations([path])
    conversations, _ = load_conversations([path], require_assistant=False)
    assert len(conversations) == 2


def test_data_without_answers_names_the_config_keys(tmp_path):
    """Read through the dataset (as the stages do), the messages name config keys, not Python arguments."""
    path = write_jsonl(tmp_path / "prompts.jsonl", record("p-0", "user"), record("p-1", "user"))
    read = functools.partial(load_dataset, strict=False, max_conversations=None, held_out_sets={})
    with pytest.raises(DataError, match=r"extract\.regenerate\.enabled=true"):
        read(DatasetConfig(name="d", paths=[str(path)]), require_assistant=True)
    with pytest.raises(ConfigError, match=r"dataset\.max_records_per_file=0"):
        read(DatasetConfig(name="d", paths=[str(path)], max_records_per_file=0), require_assistant=False)
    data = write_jsonl(tmp_path / "d.jsonl", record("d-0", "user", "assistant"))
    with pytest.raises(ConfigError, match=r"extract\.max_conversations=0"):
        read(DatasetConfig(name="d", paths=[str(data)]), require_assistant=True, max_conversations=0)
    with pytest.raises(DataError, match=r"extract\.strict=false"):
        load_dataset(
            DatasetConfig(name="d", paths=[str(path)]),
            require_assistant=True,
            strict=True,
            max_conversations=None,
            held_out_sets={},
        )


def test_empty_content_kept_unless_strict(tmp_path):
    empty = {
        "id": "e-0",
        "conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}],
    }
    path = write_jsonl(tmp_path / "empty_content.jsonl", record("e-1", "user", "assistant"), empty)
    conversations, stats = load_conversations([path])
    assert [c.id for c in conversations] == ["e-1", "e-0"] and stats.empty_content_turns == 1
    with pytest.raises(DataError, match=r"empty_content.jsonl:2: key 'conversations\[1\].content' is empty"):
        load_conversations([path], strict=True)


def test_max_records_keeps_first_kept_records_in_file_order(tmp_path):
    first = write_jsonl(tmp_path / "1.jsonl", record("a-0", "user", "assistant"), record("a-1", "user"))
    second = write_jsonl(
        tmp_path / "2.jsonl",
        record("b-0", "user", "assistant"),
        record("b-1", "user", "assistant"),
        "{broken",
    )
    conversations, stats = load_conversations([first, second], max_records=2)
    assert [c.id for c in conversations] == ["a-0", "b-0"]
    assert stats.hit_max_records and stats.skipped_no_assistant == 1
    assert stats.per_file == {str(first): 1, str(second): 1}
    # Without the cap the broken line at the end is read and reported.
    with pytest.raises(DataError, match=r"2.jsonl:3"):
        load_conversations([first, second])
    conversations, _ = load_conversations([first, second], max_records=3, require_assistant=False)
    assert [c.id for c in conversations] == ["a-0", "a-1", "b-0"]
    conversations, stats = load_conversations([first], max_records=10)
    assert len(conversations) == 1 and not stats.hit_max_records


@pytest.mark.skipif(not OASST.is_file(), reason="shared data not mounted")
def test_real_multi_turn_file():
    conversations, stats = load_conversations([OASST], strict=True)
    assert stats.records == stats.kept == len(conversations) == 95
    assert Counter(len(c.turns) for c in conversations) == {4: 52, 2: 42, 6: 1}
    assert all(isinstance(c, Conversation) and c.turns[0].role == "user" for c in conversations)
    assert [c.line for c in conversations] == list(range(1, 96))
    with OASST.open(encoding="utf-8") as handle:
        assert [json.loads(line) for line in handle] == [c.to_json() for c in conversations]


def test_dataset_spans_its_files_holds_out_eval_prompts_and_is_capped(tmp_path):
    def chat(cid: str, prompt: str) -> dict:
        return {
            "id": cid,
            "conversations": [{"role": "user", "content": prompt}, {"role": "assistant", "content": "ok"}],
        }

    a = write_jsonl(
        tmp_path / "a.jsonl", chat("a-0", "Hello there"), chat("a-1", "What is 2+2?"), record("a-2", "user")
    )
    b = write_jsonl(tmp_path / "b.jsonl", chat("b-0", "Name a colour"))
    held = write_jsonl(
        tmp_path / "eval.jsonl", {"id": "e", "conversations": [{"role": "user", "content": "what is  2+2?"}]}
    )
    sets = {"math": EvalSetConfig(path=str(held), count=1)}
    dataset = DatasetConfig(name="d", paths=[str(a), str(b)], holdout_eval_sets=True)
    read = functools.partial(load_dataset, require_assistant=True, strict=False, held_out_sets=sets)
    conversations, no_assistant = read(dataset, max_conversations=None)
    assert [c.id for c in conversations] == ["a-0", "b-0"] and no_assistant == 1
    assert [c.id for c in read(dataset, max_conversations=1)[0]] == ["a-0"]
    kept = DatasetConfig(name="d", paths=[str(a), str(b)], max_records_per_file=2)
    assert [c.id for c in read(kept, max_conversations=None)[0]] == ["a-0", "a-1", "b-0"]
    twice = DatasetConfig(name="d", paths=[str(a), str(a)])
    with pytest.raises(DataError, match="also appears at"):
        read(twice, max_conversations=None)


def test_a_missing_data_folder_says_where_shared_data_comes_from(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="EAGLET_SHARED_DATA"):
        load_conversations([tmp_path / "no-such-folder" / "prompts.jsonl"])
