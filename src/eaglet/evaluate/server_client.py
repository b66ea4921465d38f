"""Plain HTTP to a vLLM or SGLang server: readiness, one greedy completion of token ids, and the engine's
speculative-decoding counts.

vLLM: POST /v1/completions with the prompt as token ids (the text comes back with `usage.completion_tokens`),
counts from GET /metrics. SGLang: POST /generate with `input_ids` (its native endpoint: only its answers carry
`meta_info` with the per-request counts). Both: GET /health and /v1/models. Prompts are token ids rendered
by eaglet with the run's chat template, exactly as in-process evaluation decodes them.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from eaglet.errors import ConfigError, DataError
from eaglet.evaluate.server_metrics import SpecCounts, sglang_counts, vllm_snapshot


class ServerRequestError(DataError):
    """A server answered a request with an error."""


@dataclass(frozen=True)
class Completion:
    text: str
    tokens: int
    seconds: float
    counts: SpecCounts | None  # SGLang: this request's counts; vLLM: None (read from /metrics)


def normalize_url(url: str, key: str) -> str:
    """http://host:8000, http://host:8000/ and http://host:8000/v1 name the same server."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{key}={url!r}: expected http://host:port")
    return url.removesuffix("/v1")


class ServerClient:
    """One server; `engine` is "vllm" or "sglang"."""

    def __init__(self, base: str, engine: str, *, timeout: float) -> None:
        self.base, self.engine, self.timeout = base, engine, timeout
        self.model = ""

    def ready(self) -> bool:
        """Whether the server answers /health (and then lists its model)."""
        try:
            self._get("/health", timeout=5.0)
            models = json.loads(self._get("/v1/models", timeout=10.0)).get("data") or []
        except (ServerRequestError, ValueError, KeyError):
            return False
        if not models:
            return False
        self.model = str(models[0]["id"])
        return True

    def complete(self, prompt: list[int], max_new_tokens: int, draft_length: int) -> Completion:
        """One greedy completion, timed from the request to the whole answer."""
        if self.engine == "sglang":
            body: dict[str, Any] = {
                "input_ids": prompt,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens},
            }
            start = time.perf_counter()
            answer = self._post("/generate", body)
            seconds = time.perf_counter() - start
            meta = answer.get("meta_info") or {}
            tokens = int(meta.get("completion_tokens") or 0)
            return Completion(str(answer.get("text", "")), tokens, seconds, sglang_counts(meta, draft_length))
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0.0}
        start = time.perf_counter()
        answer = self._post("/v1/completions", body)
        seconds = time.perf_counter() - start
        choices = answer.get("choices") or [{}]
        tokens = int((answer.get("usage") or {}).get("completion_tokens") or 0)
        return Completion(str(choices[0].get("text", "")), tokens, seconds, None)

    def spec_counts(self) -> SpecCounts | None:
        """vLLM's counters now (None: the server exposes no speculative-decoding counters)."""
        return vllm_snapshot(self.metrics_text())

    def metrics_text(self) -> str:
        return self._get("/metrics", timeout=self.timeout)

    def _get(self, path: str, *, timeout: float) -> str:
        return self._send(urllib.request.Request(self.base + path, method="GET"), timeout)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        return json.loads(self._send(request, self.timeout))

    def _send(self, request: urllib.request.Request, timeout: float) -> str:
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.read().decode()
        except urllib.error.HTTPError as err:
            detail = " ".join(err.read().decode(errors="replace").split())[:300]
            raise ServerRequestError(
                f"{request.get_method()} {request.full_url}: HTTP {err.code}: {detail}; see the server's log"
            ) from None
        except OSError as err:  # refused, reset, timed out
            reason = err.reason if isinstance(err, urllib.error.URLError) else err
            raise ServerRequestError(
                f"{request.get_method()} {request.full_url}: no answer ({reason}); check that the server is up "
                "(its log), or raise eval.server.request_timeout_s"
            ) from None
