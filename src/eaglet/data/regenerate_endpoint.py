"""Regeneration through an OpenAI-compatible chat endpoint (a vLLM or SGLang server).

    python extract.py ... extract.regenerate.endpoint=http://host:8000/v1

Same contract as the in-process path: each conversation's user turns go to /v1/chat/completions in order,
the answer to user turn r generated from the conversation so far including the target's own earlier
answers; a finished conversation is appended to the regenerated JSONL (shared schema + prompt_hash) and
fsynced, so a restart requests only the conversations not on disk. Up to `concurrency` conversations are
in flight, one request each. The `openai` client retries connection errors, timeouts, 408/409, 429 and 5xx
with exponential backoff and jitter (0.5 s doubling to 8 s, or the server's Retry-After) up to
`max_retries` times; any other 4xx stops the run with an error naming the conversation.

Thinking mode: `thinking` is sent as `chat_template_kwargs` under both names chat templates read:
`thinking` (Kimi K2.5, DeepSeek V3.1) and `enable_thinking` (Qwen3, SmolLM3, GLM). vLLM drops kwargs the
template does not use, SGLang passes them to Jinja, which ignores unknown names.

Reasoning storage: the shared schema has one `content` per turn, and the draft must learn every token the
target generates, thinking included. A server started without a reasoning parser returns the raw text
(`<think>...</think>answer`), which is stored as is. A server with a reasoning parser returns the thinking
apart (vLLM `reasoning`, older vLLM and SGLang `reasoning_content`); it is stored folded back in front of
the answer as `<think>{reasoning}</think>{answer}`, the form the Kimi K2.x, Qwen3 and DeepSeek-R1 templates
render. Whitespace around the markers may then differ from what the model generated: for token-exact
data start the server without `--reasoning-parser`. Later turns are sent the stored content, as the
in-process path does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import openai
from tqdm.auto import tqdm

from eaglet.config.schema import RegenerateConfig
from eaglet.data.conversations import Conversation, Turn
from eaglet.data.regenerate_stats import RegenerateStats
from eaglet.data.regenerated import (
    answered_prefixes,
    append_finished,
    kept_turns,
    prompt_hash,
    read_finished,
    user_turn_groups,
)
from eaglet.data.templating import THINKING_VARIABLES, build_prompt_ids
from eaglet.errors import ConfigError, EagletError

# Where servers put thinking split off by a reasoning parser: vLLM (renamed late 2025), older vLLM and SGLang.
REASONING_FIELDS = ("reasoning", "reasoning_content")
# Statuses the client retries (besides 5xx); any other 4xx is final.
_RETRIED = (408, 409, 429)
# The start-up check fails fast: a server that is down should not cost a full retry schedule.
_CHECK_TIMEOUT_S = 30.0


class EndpointError(ConfigError):
    """The regeneration endpoint is unreachable, or rejected or failed a request."""


def served_model(cfg: RegenerateConfig) -> str:
    """The model name to request: `endpoint_model`, else the one model the server lists at /models.

    Also the start-up check: an unreachable or wrong endpoint ends here in one actionable line.
    """
    _check_settings(cfg)
    url = cfg.endpoint
    client = openai.OpenAI(base_url=url, api_key=_api_key(), max_retries=0, timeout=_CHECK_TIMEOUT_S)
    try:
        served = [entry.id for entry in client.models.list()]
    except openai.APIConnectionError as exc:  # refused, DNS, TLS, timeout
        raise EndpointError(
            f"cannot reach the regeneration endpoint {url} (GET /models: {_reason(exc)}); start the server "
            "(vllm serve <model> or python -m sglang.launch_server --model-path <model>) and wait until it "
            "answers, or fix extract.regenerate.endpoint (scheme, host, port, and the /v1 suffix)"
        ) from None
    except openai.APIStatusError as exc:
        raise EndpointError(
            f"the regeneration endpoint {url} answered GET /models with HTTP {exc.status_code} "
            f"({_server_message(exc)}); {_status_hint(exc.status_code, url)}"
        ) from None
    finally:
        client.close()
    if cfg.endpoint_model is not None:
        if cfg.endpoint_model not in served:
            raise EndpointError(
                f"extract.regenerate.endpoint_model={cfg.endpoint_model!r} is not served by {url}, which "
                f"serves {served}; set it to one of those"
            )
        return cfg.endpoint_model
    if len(served) != 1:
        raise EndpointError(
            f"the regeneration endpoint {url} serves {len(served)} models {served}; pick one with "
            "extract.regenerate.endpoint_model=<name>"
        )
    return served[0]


def endpoint_output_path(
    base: Path, cfg: RegenerateConfig, model: str, template_kwargs: Mapping[str, Any] | None = None
) -> Path:
    """`base` with a suffix keyed by what changes an endpoint's answers beyond the caller's key."""
    other = {k: v for k, v in (template_kwargs or {}).items() if k not in THINKING_VARIABLES}
    fields = {"model": model, "thinking": cfg.thinking, **({"template_kwargs": other} if other else {})}
    key = json.dumps(fields, sort_keys=True)
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]
    return base.with_name(f"{base.stem}-endpoint-{digest}{base.suffix}")


def regenerate_via_endpoint(
    conversations: Sequence[Conversation],
    *,
    cfg: RegenerateConfig,
    model: str,
    out_path: Path,
    max_length: int,
    tokenizer: Any = None,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> tuple[list[Conversation], RegenerateStats]:
    """Regenerated copies of `conversations` (same ids and order) from the endpoint, resuming from `out_path`;
    each request carries a sampling seed derived from `seed` (the run's seed), its conversation and turn.

    With a `tokenizer`, a conversation is cut before the turn whose prompt plus `max_new_tokens` exceeds
    `max_length` tokens, exactly as in-process (prompts rendered with `chat_template`, which should be the
    server's). Without one, every turn is sent and the server enforces its own context length.
    """
    _check_settings(cfg)
    stats = RegenerateStats(conversations=len(conversations))
    done = read_finished(out_path, {c.id: prompt_hash(c) for c in conversations})
    stats.resumed = len(done)
    pending = [c for c in conversations if c.id not in done]
    prefixes = answered_prefixes(out_path, pending)
    stats.reused_turns = sum(t.role == "assistant" for turns in prefixes.values() for t in turns)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if template_kwargs is None:
        template_kwargs = dict.fromkeys(THINKING_VARIABLES, cfg.thinking)
    session = _Session(
        cfg, seed, model, max_length, tokenizer, chat_template, dict(template_kwargs), stats, prefixes
    )
    start = time.perf_counter()
    with (
        open(out_path, "ab") as sink,
        tqdm(total=len(conversations), initial=len(done), desc="regenerate", unit="conv") as bar,
    ):

        def finished(source: Conversation, regenerated: Conversation) -> None:
            append_finished(sink, [(source, regenerated)])
            done[source.id] = regenerated
            bar.update(1)
            bar.set_postfix(tok_s=f"{stats.generated_tokens / max(time.perf_counter() - start, 1e-9):.0f}")

        try:
            asyncio.run(session.run(pending, finished))
        except EagletError as exc:
            # Every conversation finished before the failure is on disk: a rerun continues from there.
            raise type(exc)(
                f"{exc} ({len(done)} of {len(conversations)} conversations are done and kept in {out_path}; "
                "a rerun continues after them)"
            ) from None
    stats.seconds = time.perf_counter() - start
    return [done[c.id] for c in conversations], stats


class _Session:
    """One run's requests: a bounded pool of workers, each answering one conversation at a time."""

    def __init__(
        self,
        cfg: RegenerateConfig,
        seed: int,
        model: str,
        max_length: int,
        tokenizer: Any,
        chat_template: str | None,
        template_kwargs: dict[str, Any],
        stats: RegenerateStats,
        prefixes: dict[str, list[Turn]],
    ) -> None:
        self.cfg, self.seed = cfg, seed
        self.prefixes = prefixes
        self.template_kwargs = template_kwargs
        self.model = model
        self.max_length = max_length
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.stats = stats

    async def run(
        self, pending: list[Conversation], finished: Callable[[Conversation, Conversation], None]
    ) -> None:
        if not pending:
            return
        # The HTTP library logs every request at INFO: at 100k requests that floods the Hydra run log.
        # Retries stay visible (the client logs them under "openai").
        logging.getLogger("httpx2").setLevel(logging.WARNING)
        client = openai.AsyncOpenAI(
            base_url=self.cfg.endpoint,
            api_key=_api_key(),
            max_retries=self.cfg.max_retries,
            timeout=self.cfg.request_timeout_s,
        )
        queue = iter(pending)  # shared: each idle worker takes the next conversation

        async def worker() -> None:
            for conv in queue:
                finished(conv, await self.answer(client, conv))

        async with client:
            try:
                async with asyncio.TaskGroup() as group:
                    for _ in range(min(self.cfg.concurrency, len(pending))):
                        group.create_task(worker())
            except ExceptionGroup as failures:
                # One error stands for the run (the other workers were cancelled): a clear one if any.
                leaves = _leaves(failures)
                raise next((e for e in leaves if isinstance(e, EagletError)), leaves[0]) from None

    async def answer(self, client: openai.AsyncOpenAI, conv: Conversation) -> Conversation:
        """`conv` with every user turn answered by the endpoint, in order (after those its record answered)."""
        history = list(self.prefixes.get(conv.id, []))
        groups = user_turn_groups(conv)
        answered = sum(turn.role == "assistant" for turn in history)
        for index, group in enumerate(groups[answered:], start=answered):
            turns = history + group
            if self.tokenizer is not None:
                ids = build_prompt_ids(self.tokenizer, turns, chat_template=self.chat_template)
                if len(ids) + self.cfg.max_new_tokens > self.max_length:
                    self.stats.cut_for_length += 1
                    break
            reply = await self.complete(client, conv, index, turns)
            history = [*turns, Turn("assistant", reply)]
        return Conversation(id=conv.id, turns=kept_turns(history, groups), source=conv.source, line=conv.line)

    async def complete(
        self, client: openai.AsyncOpenAI, conv: Conversation, index: int, turns: list[Turn]
    ) -> str:
        cfg = self.cfg
        where = f"{conv.where}: conversation {conv.id!r}, user turn {index + 1}"
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=self.model,
                messages=[{"role": t.role, "content": t.content} for t in turns],  # type: ignore[misc]
                max_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                seed=_request_seed(self.seed, conv.id, index),
                n=1,
                extra_body={"chat_template_kwargs": self.template_kwargs},
            )
        except openai.APIStatusError as exc:
            retried = exc.status_code in _RETRIED or exc.status_code >= 500
            after = f" after {cfg.max_retries} retries" if retried else ""
            raise EndpointError(
                f"{where}: {cfg.endpoint} answered HTTP {exc.status_code}{after} "
                f"({_server_message(exc)}); {_status_hint(exc.status_code, cfg.endpoint)}"
            ) from None
        except openai.APIConnectionError as exc:
            raise EndpointError(
                f"{where}: no answer from {cfg.endpoint} after {cfg.max_retries} retries ({_reason(exc)}); "
                "check that the server is up (its log), or raise extract.regenerate.max_retries / "
                "request_timeout_s"
            ) from None
        self.stats.retries += raw.retries_taken
        completion = raw.parse()
        if not completion.choices:
            raise EndpointError(f"{where}: {cfg.endpoint} answered with no choices; check the server's log")
        message = completion.choices[0].message
        self.stats.generated_turns += 1
        self.stats.generated_tokens += completion.usage.completion_tokens if completion.usage else 0
        return _stored_content(message.content, _reasoning(message))


def _stored_content(content: str | None, reasoning: str | None) -> str:
    """The turn's content as stored: thinking folded back in front of the answer (module docstring)."""
    answer = content or ""
    if reasoning:
        answer = f"<think>{reasoning}</think>{answer}"
    # Stripped like the in-process path's decoded replies, so both produce the same records.
    return answer.strip()


def _reasoning(message: Any) -> str | None:
    for name in REASONING_FIELDS:
        value = getattr(message, name, None)
        if isinstance(value, str) and value:
            return value
    return None


def _request_seed(seed: int, conv_id: str, index: int) -> int:
    """A per-turn sampling seed that does not depend on scheduling: a resumed run draws the same answers."""
    digest = hashlib.sha256(f"{seed}\0{conv_id}\0{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def _check_settings(cfg: RegenerateConfig) -> None:
    if not cfg.endpoint or not cfg.endpoint.startswith(("http://", "https://")):
        raise ConfigError(
            f"extract.regenerate.endpoint={cfg.endpoint!r} is not an http(s) URL; give the server's "
            "OpenAI base URL, e.g. http://host:8000/v1"
        )
    checks = (
        ("concurrency", cfg.concurrency >= 1, "a positive number of requests in flight"),
        ("max_retries", cfg.max_retries >= 0, "zero or more"),
        ("request_timeout_s", cfg.request_timeout_s > 0, "a positive number of seconds"),
        ("max_new_tokens", cfg.max_new_tokens >= 1, "a positive number of tokens"),
    )
    for key, ok, want in checks:
        if not ok:
            raise ConfigError(f"extract.regenerate.{key}={getattr(cfg, key)!r}: must be {want}")


def _api_key() -> str:
    # vLLM and SGLang accept any key unless started with --api-key; the client insists on one.
    return os.environ.get("OPENAI_API_KEY") or "EMPTY"


def _status_hint(status: int, url: str | None) -> str:
    if status in (401, 403):
        return "set OPENAI_API_KEY to the key the server was started with (--api-key)"
    if status == 404 and url and not url.rstrip("/").endswith("/v1"):
        return (
            f"the endpoint is the server's OpenAI base URL, usually ending in /v1 (e.g. {url.rstrip('/')}/v1)"
        )
    if status == 404:
        return "check extract.regenerate.endpoint and extract.regenerate.endpoint_model against the server"
    if status == 429 or status >= 500:
        return "check the server's log, lower extract.regenerate.concurrency or raise max_retries"
    return "the server's message says what it rejected (e.g. a prompt longer than its --max-model-len: lower extract.max_length)"


def _server_message(exc: openai.APIStatusError) -> str:
    """The server's own error message (vLLM and SGLang send {"error": {"message": ...}} or {"message": ...})."""
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return _one_line(inner["message"])
    return _one_line(exc.message)


def _reason(exc: BaseException) -> str:
    """The lowest-level cause of a connection error, on one line (e.g. '[Errno 111] Connection refused')."""
    cause: BaseException = exc
    while (inner := cause.__cause__ or cause.__context__) is not None:
        cause = inner
    return _one_line(str(cause) or type(cause).__name__)


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out
