"""A vLLM server the user started (with the command eaglet prints) as a source of hidden states.

Requests go through the `openai` client on vLLM's OpenAI-compatible server: GET /version and /v1/models at
start, POST /tokenize for the tokenization check, POST /v1/completions with token ids as the prompt and
max_tokens=1 per sequence; each response's `kv_transfer_params.hidden_states_path` names the file the
connector wrote. The client retries connection errors, timeouts, 408/409, 429 and 5xx up to
`extract.vllm.max_retries` times, with exponential backoff and jitter (0.5 s doubling to 8 s), or after the
server's Retry-After (up to 2 minutes); any other 4xx stops the run with the server's message.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

from eaglet.config.schema import VllmConfig
from eaglet.errors import ConfigError, DataError
from eaglet.extract.vllm.request_file import PATH_KEY
from eaglet.extract.vllm.version import check_version


class ServerError(DataError):
    """The server refused a request (an error retrying does not fix), or did not answer after every retry."""


class ServerSource:
    def __init__(self, cfg: VllmConfig, *, architecture: str, max_model_len: int) -> None:
        self.base = normalize_url(cfg.url or "")
        self.concurrency = cfg.concurrency
        if self.concurrency < 1:
            raise ConfigError(f"extract.vllm.concurrency={self.concurrency}: must be at least 1")
        self.client = openai.OpenAI(
            base_url=self.base + "/",
            # vLLM accepts any key unless started with --api-key; the client insists on one.
            api_key=os.environ.get("OPENAI_API_KEY") or "EMPTY",
            max_retries=cfg.max_retries,
            timeout=cfg.request_timeout_s,
        )
        try:
            version = self._call("GET", "/version", retries=0)["version"]
        except (KeyError, TypeError, ServerError) as err:
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
        self.client.close()

    def _map(self, fn: Any, items: list[Any]) -> list[Any]:
        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="vllm-client") as pool:
            return list(pool.map(fn, items))

    def _call(self, method: str, path: str, body: dict | None = None, *, retries: int | None = None) -> Any:
        """One JSON request (retried by the client as the module docstring says); its answer as parsed JSON."""
        options: Any = {} if retries is None else {"max_retries": retries}
        try:
            if method == "GET":
                return self.client.get(path, cast_to=object, options=options)
            return self.client.post(path, body=body, cast_to=object, options=options)
        except openai.APIStatusError as err:
            detail = err.response.text[:300]
            raise ServerError(f"{method} {self.base}{path}: HTTP {err.status_code}: {detail}") from None
        except openai.APIConnectionError as err:  # refused, reset, timed out: after the last retry
            raise ServerError(f"{method} {self.base}{path}: no answer ({_reason(err)})") from None


def normalize_url(url: str) -> str:
    """http://host:8000, http://host:8000/ and http://host:8000/v1 all name the same server."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"extract.vllm.url={url!r}: expected http://host:port")
    return url.removesuffix("/v1")


def _reason(err: BaseException) -> str:
    cause = err.__cause__ or err  # the client wraps the transport's error
    return str(cause) or type(cause).__name__
