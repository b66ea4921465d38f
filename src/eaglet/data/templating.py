"""Chat-template conversations into token ids with a loss mask on exactly the assistant tokens.

The template is treated as a black box: for assistant turn i, rendering turns[:i] with the generation
prompt must be a prefix of rendering turns[:i+1]; the text in between is the assistant's reply (content
and end-of-turn marker). The whole conversation is tokenized once and character spans map to tokens
through the tokenizer's offsets, so any template whose earlier turns render stably works.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import pickle
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from eaglet.data.conversations import Conversation, Turn
from eaglet.errors import ConfigError, DataError, EagletError


class ChatTemplateError(ConfigError):
    """The chat template fails on a conversation or renders it so that assistant replies cannot be located."""


@dataclass(frozen=True, eq=False)
class TokenizedConversation:
    id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]: 1 on assistant content and end-of-turn tokens, 0 on role headers
    truncated: bool  # True when cut at max_length

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_masked(self) -> int:
        return int(self.loss_mask.sum())


def resolve_chat_template(
    tokenizer: Any, override: str | None, variables: Mapping[str, Any] | None = None
) -> str:
    """The override if given, else the tokenizer's own chat template; `variables` set at its top.

    Setting them inside the template (rather than passing them at each render) makes every rendering see
    them, and puts them into the template's hash, so shards record the mode they were rendered in.
    """
    template = _template_text(tokenizer, override)
    header = ""
    for name, value in (variables or {}).items():
        if not str(name).isidentifier():
            raise ConfigError(
                f"model.chat_template_kwargs: {name!r} is not a template variable name (letters, digits, _)"
            )
        header += "{%- set " + str(name) + " = " + json.dumps(value) + " -%}"
    return header + template


def chat_template_variables(model: Any, regenerate: Any) -> dict[str, Any]:
    """The variables of model.chat_template_kwargs, plus the thinking switch sent to a regeneration server
    (so that eaglet renders the answers in the mode they were generated in), unless set explicitly."""
    variables = dict(model.chat_template_kwargs or {})
    if regenerate.enabled and regenerate.endpoint:
        for name in THINKING_VARIABLES:
            variables.setdefault(name, bool(regenerate.thinking))
    return variables


def _template_text(tokenizer: Any, override: str | None) -> str:
    if override is not None:
        if not override.strip():
            raise ConfigError(
                "model.chat_template is empty; pass a Jinja chat template or leave it unset (null)"
            )
        return override
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # tokenizers that ship several named templates
        template = template.get("default")
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(
            f"the tokenizer {name!r} has no chat template; pass one as a Jinja string with "
            "model.chat_template='...' (the template the target model was trained with)"
        )
    return template


# Template variables that switch thinking on or off: Kimi K2.5 / DeepSeek V3.1, and Qwen3 / SmolLM3 / GLM.
THINKING_VARIABLES = ("thinking", "enable_thinking")


def chat_template_hash(template: str) -> str:
    """Short content hash of a template, to record which template produced a dataset."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()[:16]


def tokenize_conversation(
    tokenizer: Any, conversation: Conversation, *, max_length: int, chat_template: str | None = None
) -> TokenizedConversation:
    """Token ids of the whole rendered conversation (head kept up to `max_length`) and its assistant mask."""
    if max_length < 1:
        raise ConfigError(f"max_length must be a positive number of tokens, got {max_length}")
    template = resolve_chat_template(tokenizer, chat_template)
    text = _render(
        tokenizer, template, conversation.turns, generation_prompt=False, where=_label(conversation)
    )
    spans = _assistant_spans(tokenizer, template, conversation, text)

    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if "offset_mapping" not in encoding:  # Python-backend tokenizers ignore return_offsets_mapping
        raise ConfigError(
            f"tokenizer {type(tokenizer).__name__} gives no character offsets, which the loss mask needs; "
            "load a fast (tokenizers-backed) tokenizer"
        )
    input_ids = np.asarray(encoding["input_ids"], dtype=np.int32)
    # A token belongs to the span its first character is in: a token straddling a header and the reply
    # (e.g. a newline merged across the boundary) stays with the header, which is never masked.
    starts = np.asarray([start for start, _ in encoding["offset_mapping"]], dtype=np.int64)
    loss_mask = np.zeros(input_ids.shape[0], dtype=np.uint8)
    for begin, end in spans:
        loss_mask[(starts >= begin) & (starts < end)] = 1

    truncated = input_ids.shape[0] > max_length
    return TokenizedConversation(
        id=conversation.id,
        input_ids=input_ids[:max_length],
        loss_mask=loss_mask[:max_length],
        truncated=truncated,
    )


# Conversations per task of a tokenizing worker: large enough that pickling them costs little against rendering.
_CHUNK = 256
# Below this many conversations one process is quicker than starting workers (each unpickles the tokenizer).
PARALLEL_FROM = 4096
_worker: dict[str, Any] = {}


def tokenize_conversations(
    tokenizer: Any,
    conversations: Sequence[Conversation],
    *,
    max_length: int,
    chat_template: str,
    workers: int | None = None,
) -> Iterator[TokenizedConversation | None]:
    """tokenize_conversation over `conversations`, in order (None for one without an assistant turn).

    Rendering the chat template is Python work, ~0.5M tokens/s on one core: for a large set (`workers` None: from
    PARALLEL_FROM conversations, one worker per core up to 16) it is spread over worker processes, whose results
    are identical to a single process's."""
    if workers is None:
        workers = min(os.cpu_count() or 1, 16) if len(conversations) >= PARALLEL_FROM else 1
    if workers <= 1:
        for conv in conversations:
            yield _tokenize_one(tokenizer, conv, max_length, chat_template)
        return
    chunks = [conversations[i : i + _CHUNK] for i in range(0, len(conversations), _CHUNK)]
    # spawn, not fork: the parent may hold a CUDA context and threads (loaders, progress bars). The tokenizer goes
    # through a file: passed to the pool (~1.5 MB pickled) it would fill the pipe each worker is started through,
    # so that every start waited for the worker before to import its modules, one after another.
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="eaglet-tokenize-") as folder:
        settings = Path(folder) / "settings.pkl"
        settings.write_bytes(pickle.dumps((tokenizer, max_length, chat_template)))
        # An executor, not a multiprocessing.Pool: a worker that dies (killed for memory) fails the run instead of
        # leaving it waiting for the chunk it held.
        pool = ProcessPoolExecutor(workers, context, initializer=_start_worker, initargs=(str(settings),))
        try:
            for results in pool.map(_tokenize_chunk, chunks):
                yield from results
        except BrokenProcessPool:
            raise EagletError(
                f"a process tokenizing the conversations ({workers} in all) died, most likely for lack of memory; "
                "rerun with fewer: extract.tokenize_workers=N (1: none)"
            ) from None
        finally:
            pool.shutdown(cancel_futures=True)


def _tokenize_one(
    tokenizer: Any, conv: Conversation, max_length: int, chat_template: str
) -> TokenizedConversation | None:
    if not conv.has_assistant():
        return None
    return tokenize_conversation(tokenizer, conv, max_length=max_length, chat_template=chat_template)


def _start_worker(settings: str) -> None:
    tokenizer, max_length, chat_template = pickle.loads(Path(settings).read_bytes())
    _worker.update(tokenizer=tokenizer, max_length=max_length, chat_template=chat_template)


def _tokenize_chunk(chunk: Sequence[Conversation]) -> list[TokenizedConversation | None]:
    return [
        _tokenize_one(_worker["tokenizer"], conv, _worker["max_length"], _worker["chat_template"])
        for conv in chunk
    ]


def build_prompt_ids(tokenizer: Any, turns: Sequence[Turn], *, chat_template: str | None = None) -> list[int]:
    """Token ids of `turns` followed by the generation prompt of the next assistant turn."""
    if not turns:
        raise DataError("cannot build a prompt from no turns; pass at least one user or system turn")
    template = resolve_chat_template(tokenizer, chat_template)
    text = _render(tokenizer, template, turns, generation_prompt=True, where="prompt")
    return [int(token) for token in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _assistant_spans(
    tokenizer: Any, template: str, conversation: Conversation, text: str
) -> list[tuple[int, int]]:
    """Character spans of `text` holding each assistant reply: content plus end-of-turn marker."""
    label = _label(conversation)
    spans = []
    for index, turn in enumerate(conversation.turns):
        if turn.role != "assistant":
            continue
        if index == 0:
            raise DataError(
                f"{label} starts with an assistant turn, so there is no prompt before it; "
                "drop the leading assistant turn"
            )
        prompt = _render(tokenizer, template, conversation.turns[:index], generation_prompt=True, where=label)
        through = _render(
            tokenizer, template, conversation.turns[: index + 1], generation_prompt=False, where=label
        )
        if not through.startswith(prompt) or not text.startswith(through):
            raise ChatTemplateError(
                f"{label}, turn {index} (assistant): the chat template renders earlier turns differently "
                "once later turns follow (or its generation prompt differs from the assistant header), so "
                "the reply cannot be located; pass a template that renders past turns unchanged with "
                "model.chat_template='...'"
            )
        # Whitespace after the end-of-turn marker (ChatML's newline) is never generated by the model.
        spans.append((len(prompt), max(len(prompt), len(through.rstrip()))))
    return spans


def _label(conversation: Conversation) -> str:
    return f"{conversation.where}: conversation {conversation.id!r}"


def _render(
    tokenizer: Any, template: str, turns: Sequence[Turn], *, generation_prompt: bool, where: str
) -> str:
    messages = [{"role": turn.role, "content": turn.content} for turn in turns]
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, chat_template=template, add_generation_prompt=generation_prompt
        )
    except jinja2.TemplateError as err:
        raise ChatTemplateError(
            f"{where}: the chat template rejected it ({err}); fix the conversation (e.g. roles must "
            "alternate) or pass a template that accepts it with model.chat_template='...'"
        ) from None
