"""How vLLM and SGLang serve a draft: the speculative settings and the command lines that start each engine.

One builder for the commands eaglet prints (evaluate.py, the sweep summary) and the servers it launches to
measure a head (eaglet.evaluate.server_stage), so what is measured is what a user would serve. Only public,
documented flags: vLLM's `--speculative-config` JSON (methods "eagle3" and "ngram"), SGLang's
`--speculative-algorithm EAGLE3|NGRAM` and its `--speculative-*` flags.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_EXECUTABLE = ("vllm", "serve")
SGLANG_EXECUTABLE = ("python", "-m", "sglang.launch_server")
# Tokenizer-side dtype names eaglet accepts, as the engines spell them; "auto" is left to the engine.
_ENGINE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class Speculation:
    """What a server drafts with: an EAGLE-3 head (`draft_dir`) or n-gram prompt lookup, `draft_length` tokens."""

    method: str  # "eagle3" or "ngram"
    draft_length: int
    draft_dir: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4


@dataclass(frozen=True)
class ServedTarget:
    """The target a server loads, and how."""

    model: str
    tokenizer: str | None = None
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    seed: int = 0
    dtype: str = "auto"


def speculative_config(draft_dir: str | Path, draft_length: int, tensor_parallel_size: int) -> dict[str, Any]:
    """vLLM's --speculative-config for an EAGLE-3 head; the draft shares the target's tensor-parallel group
    (vLLM accepts 1 or the target's size)."""
    config: dict[str, Any] = {
        "method": "eagle3",
        "model": str(draft_dir),
        "num_speculative_tokens": draft_length,
    }
    if tensor_parallel_size > 1:
        config["draft_tensor_parallel_size"] = tensor_parallel_size
    return config


def ngram_speculative_config(draft_length: int, min_n: int, max_n: int) -> dict[str, Any]:
    """vLLM's --speculative-config for prompt lookup, with the n-gram sizes of eaglet's own NgramProposer."""
    return {
        "method": "ngram",
        "num_speculative_tokens": draft_length,
        "prompt_lookup_min": min_n,
        "prompt_lookup_max": max_n,
    }


def vllm_speculative_args(spec: Speculation, tensor_parallel_size: int = 1) -> list[str]:
    if spec.method == "ngram":
        config = ngram_speculative_config(spec.draft_length, spec.ngram_min, spec.ngram_max)
    else:
        config = speculative_config(spec.draft_dir or "", spec.draft_length, tensor_parallel_size)
    return ["--speculative-config", json.dumps(config)]


def sglang_speculative_args(spec: Speculation) -> list[str]:
    # SGLang counts the verified token in --speculative-num-draft-tokens: a chain of K drafts verifies K + 1.
    if spec.method == "ngram":
        return [
            "--speculative-algorithm", "NGRAM",
            "--speculative-num-draft-tokens", str(spec.draft_length + 1),
            "--speculative-ngram-min-match-window-size", str(spec.ngram_min),
            "--speculative-ngram-max-match-window-size", str(spec.ngram_max),
        ]  # fmt: skip
    return [
        "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", str(spec.draft_dir),
        "--speculative-num-steps", str(spec.draft_length),
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(spec.draft_length + 1),
    ]  # fmt: skip


def vllm_args(target: ServedTarget, spec: Speculation | None, *, host: str, port: int) -> list[str]:
    """Arguments after `vllm serve`: the target first (positional), then the flags."""
    args = [target.model, "--host", host, "--port", str(port), "--seed", str(target.seed)]
    args += ["--tensor-parallel-size", str(target.tensor_parallel_size)]
    if target.tokenizer:
        args += ["--tokenizer", target.tokenizer]
    if target.trust_remote_code:
        args.append("--trust-remote-code")
    if target.dtype != "auto":
        args += ["--dtype", _ENGINE_DTYPES.get(target.dtype, target.dtype)]
    if spec is not None:
        args += vllm_speculative_args(spec, target.tensor_parallel_size)
    return args


def sglang_args(target: ServedTarget, spec: Speculation | None, *, host: str, port: int) -> list[str]:
    """Arguments after `python -m sglang.launch_server`."""
    args = ["--model-path", target.model, "--host", host, "--port", str(port)]
    args += ["--random-seed", str(target.seed), "--tp-size", str(target.tensor_parallel_size)]
    if target.tokenizer:
        args += ["--tokenizer-path", target.tokenizer]
    if target.trust_remote_code:
        args.append("--trust-remote-code")
    if target.dtype != "auto":
        args += ["--dtype", _ENGINE_DTYPES.get(target.dtype, target.dtype)]
    if spec is not None:
        args += sglang_speculative_args(spec)
    return args


def vllm_command(draft_dir: str | Path, draft_length: int, tensor_parallel_size: int) -> str:
    """`vllm serve TARGET ...` for an EAGLE-3 head, as printed for a user to run."""
    tp = ["--tensor-parallel-size", str(tensor_parallel_size)] if tensor_parallel_size > 1 else []
    spec = Speculation("eagle3", draft_length, str(draft_dir))
    return shlex.join([*VLLM_EXECUTABLE, "TARGET", *tp, *vllm_speculative_args(spec, tensor_parallel_size)])


def sglang_command(draft_dir: str | Path, draft_length: int) -> str:
    spec = Speculation("eagle3", draft_length, str(draft_dir))
    return shlex.join([*SGLANG_EXECUTABLE, "--model-path", "TARGET", *sglang_speculative_args(spec)])


def serve_commands(draft_dir: str | Path, draft_length: int) -> str:
    """The commands that serve an EAGLE-format head with vLLM and with SGLang, one a line."""
    return f"{vllm_command(draft_dir, draft_length, 1)}\n{sglang_command(draft_dir, draft_length)}"
