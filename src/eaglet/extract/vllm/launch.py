"""The vLLM settings eaglet needs, as `LLM(**kwargs)` for an in-process engine or as a `vllm serve` command.

Both come from one resolved `LaunchPlan`, so the engine eaglet starts and the server a user starts with the
printed command are configured alike. Only public, documented surfaces are used (`LLM`/`EngineArgs`
keyword arguments, `vllm serve` flags, dict-valued speculative and KV-transfer configs): vLLM's internal
config classes change between releases.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from eaglet.config.schema import ModelConfig
from eaglet.errors import ConfigError
from eaglet.extract.job import ExtractionJob
from eaglet.extract.vllm.layers import LayerLayout

CONNECTOR = "ExampleHiddenStatesConnector"
SPECULATIVE_METHOD = "extract_hidden_states"


@dataclass(frozen=True)
class LaunchPlan:
    model: str
    tokenizer: str | None
    trust_remote_code: bool
    dtype: str
    seed: int
    tensor_parallel_size: int
    enable_expert_parallel: bool
    max_model_len: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    layer_ids: tuple[int, ...]
    storage_dir: str


def storage_dir(job: ExtractionJob) -> Path:
    """Where vLLM writes its per-request files (absolute: the server resolves it on its side)."""
    if job.extract.vllm.storage_dir:
        return Path(job.extract.vllm.storage_dir).absolute()
    return (job.data_dir / "vllm_requests" / job.model.name / job.dataset.name).absolute()


def model_path(model: ModelConfig) -> str:
    if model.source != "path":
        raise ConfigError(
            f"extract.backend=vllm serves the target from a Hugging Face folder, but model {model.name!r} has "
            f"model.source='{model.source}'; set model.source=path model.path=/path/to/weights"
        )
    if not model.path or model.path == "???":  # (unset: the "???" of conf/model/kimi_k2_5.yaml)
        raise ConfigError(
            f"extract.backend=vllm serves model {model.name!r} from its Hugging Face folder, and none is given: "
            "set model.path=/path/to/weights (the folder with config.json and the weights)"
        )
    return str(model.path)


def resolve_launch(job: ExtractionJob, layout: LayerLayout, *, devices: int, seed: int) -> LaunchPlan:
    """The launch settings of this extraction on `devices` GPUs (the default tensor parallel size)."""
    ext, model = job.extract, job.model
    vc = ext.vllm
    tp = vc.tensor_parallel_size or devices
    if tp < 1:
        raise ConfigError(f"extract.vllm.tensor_parallel_size={tp}: must be at least 1")
    expert_parallel = vc.enable_expert_parallel
    if expert_parallel is None:
        expert_parallel = model.num_experts > 0 and tp > 1
    # One token is generated after the prompt, so the longest prompt needs one position more.
    max_model_len = vc.max_model_len or ext.max_length + 1
    if max_model_len <= ext.max_length:
        raise ConfigError(
            f"extract.vllm.max_model_len={max_model_len} must exceed extract.max_length={ext.max_length} "
            "(the prompt plus the one generated token); raise it or leave it null"
        )
    if not 0 < vc.gpu_memory_utilization <= 1:
        raise ConfigError(
            f"extract.vllm.gpu_memory_utilization={vc.gpu_memory_utilization}: must be in (0, 1]"
        )
    return LaunchPlan(
        model=model_path(model),
        tokenizer=model.tokenizer_path,
        trust_remote_code=model.trust_remote_code,
        dtype=model.dtype,
        seed=seed,
        tensor_parallel_size=tp,
        enable_expert_parallel=expert_parallel,
        max_model_len=max_model_len,
        # Chunked prefill is off, so one step must hold the longest prompt.
        max_num_batched_tokens=max(max_model_len, ext.batch_tokens),
        gpu_memory_utilization=vc.gpu_memory_utilization,
        layer_ids=tuple(layout.vllm_layer_ids),
        storage_dir=str(storage_dir(job)),
    )


def speculative_config(plan: LaunchPlan) -> dict:
    return {
        "method": SPECULATIVE_METHOD,
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(plan.layer_ids)}},
    }


def kv_transfer_config(plan: LaunchPlan) -> dict:
    return {
        "kv_connector": CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": plan.storage_dir},
    }


def engine_kwargs(plan: LaunchPlan) -> dict:
    """Keyword arguments of `vllm.LLM` (= EngineArgs fields) for hidden-state extraction."""
    kwargs = {
        "model": plan.model,
        "trust_remote_code": plan.trust_remote_code,
        "dtype": plan.dtype,
        "seed": plan.seed,
        "tensor_parallel_size": plan.tensor_parallel_size,
        "enable_expert_parallel": plan.enable_expert_parallel,
        "max_model_len": plan.max_model_len,
        "max_num_batched_tokens": plan.max_num_batched_tokens,
        "gpu_memory_utilization": plan.gpu_memory_utilization,
        # The connector saves what the current request computed: a prefix served from the cache, or a
        # prompt split over several steps, would leave rows missing (vLLM's extraction docs ask for both off).
        "enable_prefix_caching": False,
        "enable_chunked_prefill": False,
        "speculative_config": speculative_config(plan),
        "kv_transfer_config": kv_transfer_config(plan),
    }
    if plan.tokenizer:
        kwargs["tokenizer"] = plan.tokenizer
    return kwargs


def serve_command(plan: LaunchPlan, url: str | None = None) -> str:
    """The `vllm serve` command that configures a server exactly like `engine_kwargs`."""
    args = ["vllm", "serve", plan.model]
    if url is not None:
        port = urlparse(url).port
        if port is not None:
            args += ["--port", str(port)]
    if plan.tokenizer:
        args += ["--tokenizer", plan.tokenizer]
    if plan.trust_remote_code:
        args.append("--trust-remote-code")
    args += [
        "--dtype",
        plan.dtype,
        "--seed",
        str(plan.seed),
        "--tensor-parallel-size",
        str(plan.tensor_parallel_size),
    ]
    if plan.enable_expert_parallel:
        args.append("--enable-expert-parallel")
    args += [
        "--max-model-len",
        str(plan.max_model_len),
        "--max-num-batched-tokens",
        str(plan.max_num_batched_tokens),
        "--gpu-memory-utilization",
        str(plan.gpu_memory_utilization),
        "--no-enable-prefix-caching",
        "--no-enable-chunked-prefill",
        "--speculative-config",
        _compact_json(speculative_config(plan)),
        "--kv-transfer-config",
        _compact_json(kv_transfer_config(plan)),
    ]
    return shlex.join(args)


def _compact_json(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))
