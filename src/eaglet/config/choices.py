"""The closed sets of strings a config key may take.

Each is a StrEnum whose member names equal their values: a wrong value fails at composition with the key
and the allowed values, and a member still behaves as its string (`str(x)`, f-strings, `x == "flex"`).
Hand plain strings (`str(x)`) to anything pickled or serialised by type: Lightning hyperparameters, which
must load with `weights_only=True`.
"""

from __future__ import annotations

from enum import StrEnum


class ModelSource(StrEnum):
    """Where the target's weights come from."""

    gguf_package = "gguf_package"  # a GGUF file shipped in a pip package
    path = "path"  # a local Hugging Face folder (model.path)
    random = "random"  # random init from the config's dims: tests, benchmarks


class TargetDtype(StrEnum):
    """The dtype the target runs in; auto = float32 on CPU, bfloat16 on GPUs."""

    auto = "auto"
    float32 = "float32"
    fp32 = "fp32"
    bfloat16 = "bfloat16"
    bf16 = "bf16"
    float16 = "float16"
    fp16 = "fp16"


class FloatDtype(StrEnum):
    """A floating-point dtype eaglet stores tensors in: shard features, the frozen embedding table."""

    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Accelerator(StrEnum):
    cpu = "cpu"
    gpu = "gpu"


class Interconnect(StrEnum):
    """The device-to-device link of a machine."""

    none = "none"
    pcie = "pcie"
    nvlink = "nvlink"


class ExtractBackend(StrEnum):
    transformers = "transformers"
    vllm = "vllm"


class ExtractFeatures(StrEnum):
    """What extraction writes: hidden-state shards for training from disk, or token streams for online training."""

    hidden_states = "hidden_states"
    tokens = "tokens"


class TrainFeatures(StrEnum):
    """Where training's target features come from: shards on disk, the target run inside each step, or shards
    read while extraction writes them under a disk bound (extract.max_disk_gb), each deleted once trained on."""

    shards = "shards"
    online = "online"
    window = "window"


class Attention(StrEnum):
    """TTT attention: auto (flex on CUDA, sdpa on CPU), flex (block-sparse flex_attention, CUDA), sdpa."""

    auto = "auto"
    flex = "flex"
    sdpa = "sdpa"


class ExportFormat(StrEnum):
    eagle = "eagle"  # vLLM and SGLang
    speculators = "speculators"  # vLLM and the speculators package


class TauSource(StrEnum):
    """Where a sweep trial's τ comes from: decoding against the target, or simulated on validation shards."""

    decode = "decode"
    sim = "sim"


class EvalBackend(StrEnum):
    """How evaluate.py (and a sweep's decoding) reaches the target: loaded in this process, or a serving engine
    that eaglet starts or connects to (eaglet.evaluate.server_stage)."""

    in_process = "in_process"
    vllm_server = "vllm_server"
    sglang_server = "sglang_server"


class ServerRole(StrEnum):
    """A server an evaluation through an engine launches: without speculation (the greedy reference and the
    speed baseline), with the trained head, with n-gram lookup, with eval.baseline_draft."""

    greedy = "greedy"
    eaglet = "eaglet"
    ngram = "ngram"
    baseline = "baseline"


class SweepObjective(StrEnum):
    speedup = "speedup"
    tau = "tau"


class AttentionKeys(StrEnum):
    """Keys a training attention query visits on GPUs: the whole packed micro-batch, or its document's."""

    row = "row"
    document = "document"


# Lightning strategies eaglet trains with (eaglet.train.strategy). hardware.strategy stays a plain string,
# checked after composition (eaglet.config.checks), so a wrong one is a ConfigError naming these.
STRATEGIES = ("auto", "ddp", "fsdp")


class GenerationEngine(StrEnum):
    """Which decoder answers in-process (eaglet.generation): auto = the engine on CUDA where it applies."""

    auto = "auto"
    engine = "engine"  # static slots and CUDA graphs: llama, mistral, qwen2, qwen3
    reference = "reference"  # any transformers model, CPU or GPU


class SampledFrom(StrEnum):
    """Which conversations get sampled answers (extract.regenerate.samples_per_prompt > 1)."""

    all = "all"  # the dataset's and the self-prompted ones
    dataset = "dataset"  # the dataset's only: more answers to people's prompts, none to the target's own
