"""Regeneration through an OpenAI-compatible endpoint, against a real HTTP server in a thread that serves the
embedded model (SmolLM2-135M-Instruct, greedy) and fails requests on cue."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import deque
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from eaglet.config.schema import RegenerateConfig
from eaglet.data.conversations import Conversation, Turn, load_conversations
from eaglet.data.regenerate import regenerate_conversations
from eaglet.data.regenerate_endpoint import EndpointError, endpoint_output_path, regenerate_via_endpoint
from eaglet.errors import ConfigError
from eaglet.target_model import load_target

MODEL = "smollm2-test"
SETTINGS = RegenerateConfig(enabled=True, max_new_tokens=6, batch_size=2, concurrency=2, max_retries=3)


class ChatServer:
    """/v1/models and /v1/chat/completions over a loaded target; `script` holds failures for the next requests."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.script: deque[Any] = deque()
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        # Hold the n-th chat request (1-based) until `release` is set; `held` is set when it arrives.
        self.hold_at: int | None = None
        self.held = threading.Event()
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._model_lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.chat = self  # type: ignore[attr-defined]
        self.root = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.url = f"{self.root}/v1"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def admit(self, body: dict) -> tuple[int, Any]:
        with self._lock:
            self.bodies.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return len(self.bodies), self.script.popleft() if self.script else None

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def generate(self, body: dict) -> tuple[str, str, int, int]:
        """(content, finish_reason, prompt tokens, completion tokens), greedy, as a server would run it."""
        tok = self.target.tokenizer
        text = tok.apply_chat_template(
            body["messages"],
            tokenize=False,
            add_generation_prompt=True,
            **body.get("chat_template_kwargs", {}),
        )
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with self._model_lock, torch.inference_mode():
            out = self.target.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=body["max_tokens"],
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
        new = out[0, ids.shape[1] :].tolist()
        finish = "stop" if new and new[-1] == tok.eos_token_id else "length"
        return tok.decode(new, skip_special_tokens=True), finish, ids.shape[1], len(new)

    def user_turns(self) -> list[tuple[str, int]]:
        """(first user message, number of messages) of every chat request so far: which conversation, which turn."""
        return [
            (next(m["content"] for m in b["messages"] if m["role"] == "user"), len(b["messages"]))
            for b in self.bodies
        ]

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/models":
            self._json(
                200, {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}
            )
        else:
            self._json(
                404, {"error": {"message": f"Not Found: {self.path}", "type": "NotFoundError", "code": 404}}
            )

    def do_POST(self) -> None:
        chat: ChatServer = self.server.chat  # type: ignore[attr-defined]
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        number, action = chat.admit(body)
        try:
            if number == chat.hold_at:
                chat.held.set()
                chat.release.wait(120)
                action = "drop"  # the client that sent it is gone
            if action == "drop":
                self.close_connection = True  # no response at all: the client sees a disconnect
            elif action in (429, 503, 400):
                message = "This model's maximum context length is 8 tokens" if action == 400 else "overloaded"
                self._json(action, {"error": {"message": message, "type": "Error", "code": action}})
            else:
                if isinstance(action, dict):  # a canned message instead of the model's answer
                    message, finish, prompt, completion = action, "stop", 1, 1
                else:
                    content, finish, prompt, completion = chat.generate(body)
                    message = {"role": "assistant", "content": content}
                self._json(
                    200,
                    {
                        "id": f"chatcmpl-{number}",
                        "object": "chat.completion",
                        "created": int(time.time()),
                        "model": body["model"],
                        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                        "usage": {
                            "prompt_tokens": prompt,
                            "completion_tokens": completion,
                            "total_tokens": prompt + completion,
                        },
                    },
                )
        finally:
            chat.leave()

    def _json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def target(model_cache: Path):
    import hydra
    from hydra.core.global_hydra import GlobalHydra

    import eaglet.config

    with hydra.initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
        cfg = hydra.compose("config")  # the embedded default target
    GlobalHydra.instance().clear()
    return load_target(cfg.model, device="cpu", cache_dir=model_cache)


@pytest.fixture
def server(target):
    chat = ChatServer(target)
    yield chat
    chat.close()


def conv(cid: str, *turns: tuple[str, str]) -> Conversation:
    return Conversation(id=cid, turns=tuple(Turn(r, c) for r, c in turns), source="mem", line=1)


CONVERSATIONS = [
    conv(
        "multi",
        ("system", "Be brief."),
        ("user", "Hi"),
        ("assistant", "old"),
        ("user", "And?"),
        ("assistant", "old2"),
    ),
    conv("prompt-only", ("user", "Count to three")),
    conv("ends-with-user", ("user", "A"), ("assistant", "old"), ("user", "B")),
]


def records(path: Path) -> list[dict]:
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda r: r["id"])


def test_endpoint_answers_equal_the_in_process_greedy_answers(target, server, tmp_path: Path) -> None:
    local, _ = regenerate_conversations(
        target.model,
        target.tokenizer,
        CONVERSATIONS,
        cfg=SETTINGS,
        out_path=tmp_path / "local.jsonl",
        max_length=512,
    )
    cfg = replace(SETTINGS, endpoint=server.url)
    remote, stats = regenerate_conversations(
        None, target.tokenizer, CONVERSATIONS, cfg=cfg, out_path=tmp_path / "remote.jsonl", max_length=512
    )
    assert [c.turns for c in remote] == [c.turns for c in local]
    assert all(t.content not in ("old", "old2") for c in remote for t in c.turns if t.role == "assistant")
    # Same records, so extraction cannot tell which path wrote them.
    written = endpoint_output_path(tmp_path / "remote.jsonl", cfg, MODEL)
    assert records(written) == records(tmp_path / "local.jsonl")
    assert stats.generated_turns == 5 and stats.retries == 0

    # Turn 2 of "multi" is asked with the target's own first answer in the history.
    second = next(b for b in server.bodies if len(b["messages"]) == 4)
    assert second["messages"][2] == {"role": "assistant", "content": remote[0].turns[2].content}
    assert all(
        b["chat_template_kwargs"] == {"thinking": False, "enable_thinking": False} for b in server.bodies
    )
    assert server.max_in_flight == 2 and len(server.bodies) == 5

    # A restart finds everything on disk and sends nothing.
    again, stats = regenerate_conversations(
        None, target.tokenizer, CONVERSATIONS, cfg=cfg, out_path=tmp_path / "remote.jsonl", max_length=512
    )
    assert stats.resumed == 3 and len(server.bodies) == 5
    assert [c.turns for c in again] == [c.turns for c in remote]


def test_thinking_is_refused_in_process(target, tmp_path: Path) -> None:
    """In-process rendering takes no template arguments: a thinking request must not be silently ignored."""
    with pytest.raises(ConfigError, match="extract.regenerate.endpoint"):
        regenerate_conversations(
            target.model,
            target.tokenizer,
            CONVERSATIONS,
            cfg=replace(SETTINGS, thinking=True),
            out_path=tmp_path / "r.jsonl",
            max_length=512,
        )


def test_overload_and_dropped_connections_are_retried(server, tmp_path: Path) -> None:
    cfg = replace(SETTINGS, endpoint=server.url)
    server.script.extend([503, "drop", 429])
    out, stats = regenerate_via_endpoint(
        CONVERSATIONS[1:2], cfg=cfg, model=MODEL, out_path=tmp_path / "r.jsonl", max_length=512
    )
    assert len(server.bodies) == 4 and stats.retries == 3
    assert [t.role for t in out[0].turns] == ["user", "assistant"] and out[0].turns[1].content

    server.script.extend(["drop", "drop", 503])
    with pytest.raises(EndpointError) as err:
        regenerate_via_endpoint(
            CONVERSATIONS[2:3],
            cfg=replace(cfg, max_retries=2),
            model=MODEL,
            out_path=tmp_path / "r.jsonl",
            max_length=512,
        )
    message = str(err.value)
    assert "'ends-with-user'" in message and "HTTP 503 after 2 retries" in message and "\n" not in message
    assert len(server.bodies) == 7


def test_a_rejected_request_is_one_clear_error_and_not_retried(server, tmp_path: Path) -> None:
    server.script.append(400)
    cfg = replace(SETTINGS, endpoint=server.url, thinking=True)
    with pytest.raises(EndpointError) as err:
        regenerate_via_endpoint(
            CONVERSATIONS[:1], cfg=cfg, model=MODEL, out_path=tmp_path / "r.jsonl", max_length=512
        )
    message = str(err.value)
    assert "conversation 'multi', user turn 1" in message and "HTTP 400" in message
    assert "maximum context length is 8 tokens" in message and "\n" not in message
    assert len(server.bodies) == 1
    assert server.bodies[0]["chat_template_kwargs"] == {"thinking": True, "enable_thinking": True}


def test_an_unreachable_endpoint_is_one_line_at_start(server, tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    for url, expected in ((closed, "Connection refused"), (server.root, "/v1")):
        with pytest.raises(ConfigError) as err:
            regenerate_conversations(
                None,
                None,
                CONVERSATIONS,
                cfg=replace(SETTINGS, endpoint=url),
                out_path=tmp_path / "r.jsonl",
                max_length=512,
            )
        message = str(err.value)
        assert url in message and expected in message and "\n" not in message
    assert not server.bodies and not list(tmp_path.iterdir())


def test_reasoning_is_stored_in_front_of_the_answer(server, tmp_path: Path) -> None:
    server.script.append({"role": "assistant", "content": "4", "reasoning": "2 and 2 make 4."})
    cfg = replace(SETTINGS, endpoint=server.url, thinking=True)
    out, _ = regenerate_via_endpoint(
        CONVERSATIONS[1:2], cfg=cfg, model=MODEL, out_path=tmp_path / "r.jsonl", max_length=512
    )
    assert out[0].turns[1].content == "<think>2 and 2 make 4.</think>4"


def test_conversations_are_cut_where_the_prompt_outgrows_the_budget(target, server, tmp_path: Path) -> None:
    long = conv("long", ("user", "word " * 50), ("assistant", "x"), ("user", "more " * 200))
    cfg = replace(SETTINGS, endpoint=server.url)
    out, stats = regenerate_via_endpoint(
        [long],
        cfg=cfg,
        model=MODEL,
        out_path=tmp_path / "r.jsonl",
        max_length=120,
        tokenizer=target.tokenizer,
    )
    assert stats.cut_for_length == 1 and len(server.bodies) == 1
    assert [t.role for t in out[0].turns] == ["user", "assistant"]


CLIENT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from eaglet.config.schema import RegenerateConfig
    from eaglet.data.conversations import load_conversations
    from eaglet.data.regenerate_endpoint import regenerate_via_endpoint
    convs, _ = load_conversations([sys.argv[1]], require_assistant=False)
    cfg = RegenerateConfig(enabled=True, max_new_tokens=6, endpoint=sys.argv[2], concurrency=1)
    regenerate_via_endpoint(convs, cfg=cfg, model=sys.argv[3], out_path=Path(sys.argv[4]), max_length=512)
    """
)


@pytest.mark.e2e
def test_a_killed_run_resumes_without_asking_again(server, tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    rows = [*CONVERSATIONS, conv("last", ("user", "Name a colour"))]
    data.write_text("".join(json.dumps(c.to_json()) + "\n" for c in rows))
    convs, _ = load_conversations([data], require_assistant=False)
    cfg = replace(SETTINGS, endpoint=server.url, concurrency=1)
    reference = tmp_path / "reference.jsonl"
    regenerate_via_endpoint(convs, cfg=cfg, model=MODEL, out_path=reference, max_length=512)
    per_conversation = [sum(t.role == "user" for t in c.turns) for c in convs]

    # Kill the client while it waits for the first request of the third conversation.
    server.bodies.clear()
    server.hold_at = per_conversation[0] + per_conversation[1] + 1
    out = tmp_path / "killed.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(data), server.url, MODEL, str(out)],
        env={**os.environ, "WANDB_MODE": "disabled"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert server.held.wait(120), proc.stderr.read().decode() if proc.poll() is not None else "no request"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    server.release.set()
    finished = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert finished == ["multi", "prompt-only"]

    server.bodies.clear()
    again, stats = regenerate_via_endpoint(convs, cfg=cfg, model=MODEL, out_path=out, max_length=512)
    assert stats.resumed == 2
    assert {first for first, _ in server.user_turns()} == {"A", "Name a colour"}
    assert len(server.bodies) == per_conversation[2] + per_conversation[3]
    assert out.read_bytes() == reference.read_bytes()


def test_a_conversation_that_gained_a_turn_asks_only_for_the_new_answer(server, tmp_path: Path) -> None:
    cfg = replace(SETTINGS, endpoint=server.url)
    out = tmp_path / "r.jsonl"
    first, _ = regenerate_via_endpoint(CONVERSATIONS[1:2], cfg=cfg, model=MODEL, out_path=out, max_length=512)
    server.bodies.clear()
    longer = [conv("prompt-only", ("user", "Count to three"), ("user", "And to four?"))]
    again, stats = regenerate_via_endpoint(longer, cfg=cfg, model=MODEL, out_path=out, max_length=512)
    assert len(server.bodies) == 1 and stats.reused_turns == 1
    assert again[0].turns[:2] == first[0].turns and again[0].turns[2] == Turn("user", "And to four?")


@pytest.mark.e2e
def test_extraction_regenerates_through_the_endpoint(compose, server, tmp_path: Path) -> None:
    """The user's command: extract.regenerate.endpoint=... makes the extraction stage ask the server."""
    from eaglet.extract.stage import run_extraction

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(c.to_json()) + "\n" for c in CONVERSATIONS))
    cfg = compose(
        "dataset=jsonl",
        f"dataset.paths=[{data}]",
        f"paths.data_dir={tmp_path / 'data'}",
        f"extract.output_dir={tmp_path / 'shards'}",
        f"extract.regenerate.endpoint={server.url}",
        "extract.regenerate.max_new_tokens=6",
        "extract.max_length=256",
    )
    summary = run_extraction(cfg)
    assert summary.regenerate is not None and summary.regenerate.generated_turns == len(server.bodies) == 5
    (regenerated,) = (tmp_path / "data" / "regenerated").glob("*-endpoint-*.jsonl")
    assert [r["id"] for r in records(regenerated)] == ["ends-with-user", "multi", "prompt-only"]
    assert summary.sequences == 3 and summary.masked_tokens > 0


def test_template_arguments_reach_the_server_and_key_the_output(server, tmp_path: Path) -> None:
    cfg = replace(SETTINGS, endpoint=server.url)
    kwargs = {"thinking": False, "enable_thinking": False, "reasoning_effort": "low"}
    regenerate_via_endpoint(
        CONVERSATIONS[1:2], cfg=cfg, model=MODEL, out_path=tmp_path / "r.jsonl", max_length=512,
        template_kwargs=kwargs,
    )  # fmt: skip
    assert server.bodies and all(b["chat_template_kwargs"] == kwargs for b in server.bodies)
    base = tmp_path / "r.jsonl"
    plain = endpoint_output_path(base, cfg, MODEL)
    assert endpoint_output_path(base, cfg, MODEL, {"thinking": True, "enable_thinking": True}) == plain
    assert endpoint_output_path(base, cfg, MODEL, kwargs) != plain
