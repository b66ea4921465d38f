"""A vLLM server the user started (with the command eaglet prints) as a source of hidden states.

Plain HTTP on vLLM's OpenAI-compatible server: GET /version and /v1/models at start, POST /tokenize for the
tokenization check, POST /v1/completions with token ids as the prompt and max_tokens=1 per sequence;
each response's `kv_transfer_params.hidden_states_path` names the file the connector wrote.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from eaglet.config.schema import VllmConfig
from eaglet.errors import ConfigError, DataError
from eaglet.extract.vllm.request_file import PATH_KEY
from eaglet.extract.vllm.version import check_version


class ServerError(DataError):
    """The server answered a request with an error that retrying does not fix."""


class ServerSource:
    def __init__(self, cfg: VllmConfig, *, architecture: str, max_model_len: int) -> None:
        self.base = normalize_url(cfg.url or "")
        self.timeout, self.retries, self.concurrency = cfg.request_timeout_s, cfg.max_retries, cfg.concurrency
        if self.concurrency < 1:
            raise ConfigError(f"extract.vllm.concurrency={self.concurrency}: must be at least 1")
        try:
            version = self._call("GET", "/version", retries=0)["version"]
        except (OSError, KeyError, ServerError) as err:
            raise ConfigError(
                f"no vLLM server answers at {cfg.url} ({_reason(err)}); start it with the `vllm serve` command "
                "printed above, or fix extract.vllm.url"
            ) from None
        self.version = str(check_version(str(version), architecture, where=f"vLLM server at {self.base}"))
        models = self._call("GET", "/v1/models")["data"]
        self.model = models[0]["id"]
        served_len = models[0].get("max_model_len")
        if served_len is not None and served_len < max_model_len:
            raise ConfigError(
                f"the server at {self.base} serves max_model_len={served_len}, but extraction needs {max_model_len} "
                "(extract.max_length + 1); restart it with the printed command or lower extract.max_length"
            )

    @property
    def description(self) -> str:
        return f"vLLM {self.version} server at {self.base} (model {self.model})"

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        def one(text: str) -> list[int]:
            body = {"model": self.model, "prompt": text, "add_special_tokens": False}
            return [int(t) for t in self._call("POST", "/tokenize", body)["tokens"]]

        return self._map(one, texts)

    def extract(self, prompts: list[list[int]]) -> list[Path]:
        def one(ids: list[int]) -> Path:
            body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
            answer = self._call("POST", "/v1/completions", body)
            params = answer.get("kv_transfer_params") or {}
            if PATH_KEY not in params:
                raise ConfigError(
                    f"the server at {self.base} returned no kv_transfer_params.{PATH_KEY}: it runs without the "
                    "hidden-states connector; restart it with the `vllm serve` command eaglet prints"
                )
            return Path(params[PATH_KEY])

        return self._map(one, prompts)

    def close(self) -> None:
        pass

    def _map(self, fn: Any, items: list[Any]) -> list[Any]:
        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="vllm-client") as pool:
            return list(pool.map(fn, items))

    def _call(self, method: str, path: str, body: dict | None = None, *, retries: int | None = None) -> Any:
        """One JSON request; connection failures, timeouts and 5xx answers are retried with backoff."""
        retries = self.retries if retries is None else retries
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        for attempt in range(retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as err:
                detail = err.read().decode(errors="replace")[:300]
                if err.code < 500 or attempt == retries:
                    raise ServerError(f"{method} {self.base}{path}: HTTP {err.code}: {detail}") from None
            except OSError:  # refused, reset, timed out
                if attempt == retries:
                    raise
            time.sleep(min(0.5 * 2**attempt, 30.0))
        raise AssertionError("unreachable")


def normalize_url(url: str) -> str:
    """http://host:8000, http://host:8000/ and http://host:8000/v1 all name the same server."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"extract.vllm.url={url!r}: expected http://host:port")
    return url.removesuffix("/v1")


def _reason(err: BaseException) -> str:
    if isinstance(err, urllib.error.URLError):
        return str(err.reason)
    return str(err) or type(err).__name__
