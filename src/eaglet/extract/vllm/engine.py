"""An in-process vLLM engine as a source of hidden states (started on first use, after the version gate)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglet.config.schema import HardwareConfig
from eaglet.errors import ConfigError, DataError
from eaglet.extract.vllm.launch import LaunchPlan, engine_kwargs
from eaglet.extract.vllm.request_file import PATH_KEY
from eaglet.extract.vllm.version import INSTALL_HINT, check_installed


class EngineSource:
    """`vllm.LLM` built from a LaunchPlan; one prompt-only request (max_tokens=1) per sequence."""

    def __init__(self, plan: LaunchPlan, hardware: HardwareConfig, architecture: str) -> None:
        self.version = str(check_installed(architecture))
        if hardware.num_nodes > 1:
            raise ConfigError(
                f"hardware={hardware.name} spans {hardware.num_nodes} nodes; an in-process vLLM engine runs on one. "
                "Start a multi-node vLLM server with the command `extract.vllm.url=...` prints and point eaglet at it"
            )
        self.plan = plan
        self._llm: Any = None

    @property
    def description(self) -> str:
        return f"vLLM {self.version} in this process (tensor parallel {self.plan.tensor_parallel_size})"

    def _engine(self) -> Any:
        if self._llm is None:
            try:
                from vllm import LLM
            except ImportError as err:
                raise ConfigError(f"vLLM is installed but does not import ({err}); {INSTALL_HINT}") from None
            Path(self.plan.storage_dir).mkdir(parents=True, exist_ok=True)
            self._llm = LLM(**engine_kwargs(self.plan))
        return self._llm

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        tokenizer = self._engine().get_tokenizer()
        return [list(tokenizer.encode(text, add_special_tokens=False)) for text in texts]

    def extract(self, prompts: list[list[int]]) -> list[Path]:
        from vllm import SamplingParams

        outputs = self._engine().generate(
            [{"prompt_token_ids": ids} for ids in prompts],
            SamplingParams(max_tokens=1, temperature=0.0),
            use_tqdm=False,
        )
        return [_file_of(output.kv_transfer_params, output.request_id) for output in outputs]

    def close(self) -> None:
        self._llm = None


def _file_of(params: dict | None, request_id: str) -> Path:
    if not params or PATH_KEY not in params:
        raise DataError(
            f"vLLM request {request_id} returned no {PATH_KEY!r}: the engine runs without the hidden-states "
            "connector; this vLLM may not support extract_hidden_states"
        )
    return Path(params[PATH_KEY])
