"""Structured-config schemas: every key a user can set, with its type and default.

Hydra merges the YAML files of each group into these dataclasses, so a typo in an override or a
value of the wrong type fails at composition and names the key; so does a value outside a closed set of
choices (eaglet.config.choices). Checks across keys run once after composition (eaglet.config.checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from eaglet.config.choices import (
    Accelerator,
    Attention,
    AttentionKeys,
    EvalBackend,
    ExportFormat,
    ExtractBackend,
    ExtractFeatures,
    FloatDtype,
    GenerationEngine,
    Interconnect,
    ModelSource,
    SampledFrom,
    ServerRole,
    SweepObjective,
    TargetDtype,
    TauSource,
    TrainFeatures,
)


@dataclass
class DraftConfig:
    """Shape of the one-layer draft head (EAGLE3.md section 1) and its vocabulary."""

    hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    head_dim: int = MISSING
    intermediate_size: int = MISSING
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    # Residual of the decoder layer taken before the hidden norm: the only variant SGLang serves.
    norm_before_residual: bool = False
    # Draft vocabulary: the most frequent target ids in the training data's loss mask.
    vocab_size: int = 32000


@dataclass
class ModelConfig:
    """The target model: identity, where its weights come from, true dimensions, aux layers."""

    name: str = MISSING
    # transformers model_type of the target (llama, qwen3, deepseek_v3, kimi_k25, ...).
    architecture: str = MISSING
    # Where the weights come from: "gguf_package" (a GGUF file shipped in a pip package), "path" (a local
    # Hugging Face folder given by the user in `path`), "random" (random init from the dims below: tests, benchmarks).
    source: ModelSource = ModelSource.path
    path: str | None = None
    gguf_package: str | None = None
    gguf_file: str | None = None
    # Tokenizer folder when it is not next to the weights; null = from `path`, or from the GGUF file.
    tokenizer_path: str | None = None
    trust_remote_code: bool = False
    # Dotted attribute path of the decoder layers; null = discover (model.layers, language_model.model.layers, ...).
    layer_path: str | None = None
    chat_template: str | None = None
    # Variables every rendering of the chat template sees (e.g. {thinking: false} for Kimi-K2.5's instant mode),
    # in extraction, regeneration and evaluation alike, and sent to servers as chat_template_kwargs.
    # From the command line: +model.chat_template_kwargs.thinking=false
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # dtype the target runs in on this machine: float32 on CPU, bfloat16 on GPUs.
    dtype: TargetDtype = TargetDtype.auto

    num_layers: int = MISSING
    hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    head_dim: int = MISSING
    intermediate_size: int = MISSING
    vocab_size: int = MISSING
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    # Mixture of experts (0 = dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    # Multi-head latent attention (DeepSeek-V3, Kimi-K2); 0 = standard attention.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Parameter counts in billions, from the model card; planning uses them.
    total_params_b: float = 0.0
    active_params_b: float = 0.0
    weight_bits: int = 16
    # Bits of the weights outside the routed experts when they differ (INT4 MoE releases keep attention and
    # shared experts in bf16); null = weight_bits.
    dense_weight_bits: int | None = None

    # Residual-stream ids the draft reads: id k = the input of decoder layer k. null = (2, L//2, L-3).
    aux_layer_ids: list[int] | None = None


@dataclass
class DatasetConfig:
    """Conversation JSONL files in the shared schema {"id", "conversations": [{"role", "content"}]}."""

    name: str = MISSING
    paths: list[str] = MISSING
    license: str = "unknown"
    # Keep at most this many conversations (in file order, per file); null = all.
    max_records_per_file: int | None = None
    # Drop conversations that contain a prompt of an evaluation set (eval.set_defs): for datasets that read
    # whole files, including the records the evaluation sets are taken from.
    holdout_eval_sets: bool = False
    description: str = ""


@dataclass
class HardwareConfig:
    """A machine (or cluster) and how Lightning should use it."""

    name: str = MISSING
    accelerator: Accelerator = Accelerator.cpu
    gpu: str = "none"
    devices: int = 1
    num_nodes: int = 1
    memory_gb_per_device: float = 0.0
    # Dense bf16 matmul rate per device (TFLOP/s) and memory bandwidth (GB/s), from datasheets.
    bf16_tflops: float = 0.0
    memory_bandwidth_gbs: float = 0.0
    # Device-to-device link: "none", "pcie" or "nvlink"; bandwidth per device in GB/s (one direction).
    interconnect: Interconnect = Interconnect.none
    interconnect_bandwidth_gbs: float = 0.0
    disk_tb: float = 0.0
    # Sustained write rate of the shard disk (GB/s, with fsync); 0 = unknown (the planner assumes its default).
    disk_write_gbs: float = 0.0
    cpu_cores: int = 0
    # Lightning settings: the one place for devices (above) and strategy. precision is Lightning's own string
    # ("32-true", "bf16-mixed", ...); strategy is one of eaglet.config.choices.STRATEGIES.
    precision: str = "32-true"
    strategy: str = "auto"
    # Packed tokens per device per micro-batch during training.
    tokens_per_device: int = 4096
    # Multi-node launch (SLURM through submitit); empty on single machines.
    slurm_partition: str | None = None
    slurm_time_min: int = 0
    slurm_gpus_per_node: int = 0


@dataclass
class RegenerateConfig:
    """Replace assistant turns by the target's own answers before extraction."""

    enabled: bool = False
    max_new_tokens: int = 256
    # 0 = greedy.
    temperature: float = 0.0
    top_p: float = 1.0
    # Answers per user turn, each its own training sequence: the first at `temperature`/`top_p` above (greedy by
    # default), the others sampled at sample_temperature/sample_top_p, with conversation ids <id>#s1, <id>#s2, ...
    samples_per_prompt: int = 1
    sample_temperature: float = 0.7
    sample_top_p: float = 0.95
    # Sampled answers for the first N conversations only (the dataset's come first, then the self-prompted ones);
    # null: for every conversation. Sampled tokens cost as much to generate as greedy ones: this spends a
    # generation budget on a share of sampled answers without giving up prompts.
    sampled_conversations: int | None = None
    # dataset: sampled answers for the dataset's conversations only (people's prompts), never the self-prompted
    # ones; sampled_conversations still caps them.
    sampled_from: SampledFrom = SampledFrom.all
    batch_size: int = 16
    # In-process: decode steps between checks for finished answers, whose rows then take the next turn.
    # Sampling is seeded by the top-level `seed`.
    refill_every: int = 16
    # In-process decoder: auto (the generation engine on CUDA for llama/mistral/qwen2/qwen3, else the
    # reference), engine, or reference.
    engine: GenerationEngine = GenerationEngine.auto
    # The engine's decode step through torch.compile (CUDA): fewer, fused kernels; a compilation at the start.
    compile: bool = True
    # The engine prefills new requests behind the window of decode steps it has just launched, not before it:
    # the host's work on the prefills overlaps the GPU's decoding, the freed rows sit out one window. The
    # same answers either way. Also for self-prompting and follow-ups.
    overlap_prefill: bool = False
    # The engine replays each prefill from a CUDA graph of its bucket shape (prompts padded to it) instead of
    # launching its kernels one by one: the host's launches were most of the prefill's time. Same answers;
    # 1.20x the new tokens/s on one H200 (experiments/BENCHMARKS.md). A capture that fails falls back to eager.
    prefill_graphs: bool = True
    # The engine prefills prompts packed end to end, without padding: null (default) where torch's
    # variable-length flash attention runs (CUDA, bf16/fp16), true everywhere, false right-padded as before.
    # Same answers. Also for self-prompting and follow-ups.
    packed_prefill: bool | None = None
    # OpenAI-compatible endpoint (vLLM or SGLang server); null = in-process with transformers.
    endpoint: str | None = None
    # Model name to request; null = the one model the endpoint lists at /v1/models.
    endpoint_model: str | None = None
    concurrency: int = 16
    max_retries: int = 5
    # Seconds one request may take (long thinking answers on a loaded server take minutes).
    request_timeout_s: float = 3600.0
    # Sent to the server's chat template as chat_template_kwargs {thinking, enable_thinking}.
    thinking: bool = False
    # Answers regenerated elsewhere (a regenerated JSONL, gzipped or not, e.g. brought back from a GPU
    # machine): those whose conversation id and prompts match are reused, the rest are generated.
    import_from: str | None = None


def _default_prompt_categories() -> dict[str, str]:
    """System prompts that steer self-prompting towards kinds of requests (name: system prompt)."""
    role = "You are a helpful AI assistant. The user will ask you"
    return {
        "coding": f"{role} to write, explain or fix code.",
        "debugging": f"{role} about an error message or a bug in their program.",
        "maths": f"{role} to solve a maths problem step by step.",
        "reasoning": f"{role} a logic puzzle or a question that needs careful reasoning.",
        "writing": f"{role} to write or edit a text: an email, a story, an essay, a poem.",
        "summarising": f"{role} to summarise, rewrite or translate a passage they give.",
        "science": f"{role} a question about physics, chemistry, biology or medicine.",
        "history": f"{role} a question about history, geography or culture.",
        "advice": f"{role} for advice: health, careers, relationships, study.",
        "everyday": f"{role} an everyday practical question: cooking, travel, home, shopping.",
        "business": f"{role} about business, economics, finance or law.",
        "brainstorming": f"{role} to brainstorm ideas or make a plan.",
        "data": f"{role} about data analysis, statistics, spreadsheets or SQL.",
        "explaining": f"{role} to explain a concept simply.",
        "roleplay": f"{role} to play a role or hold a conversation in character.",
        "general": None,
    }


@dataclass
class SelfPromptConfig:
    """The target writes user prompts itself (extract.self_prompt.num_prompts > 0); its answers are then
    regenerated (extract.regenerate.enabled=true). See eaglet.data.self_prompt."""

    # Prompts to add to the dataset's conversations (0 = none).
    num_prompts: int = 0
    # name: system prompt placed before the user turn the target writes (null: no system prompt). Prompts cycle
    # through the names in sorted order.
    categories: dict[str, Any] = field(default_factory=_default_prompt_categories)
    temperature: float = 1.0
    top_p: float = 1.0
    # Earlier user turns shown before the one the target writes: this many user prompts of the dataset, drawn
    # afresh for each prompt, each followed by `example_reply` as the assistant's turn, so that the target writes
    # requests like people's (concrete, naming what they ask about) instead of its own kind (0 = none: the
    # template up to a user turn, as Magpie). A 135M target needs a lower temperature for it (0.7, top_p 0.9).
    examples: int = 0
    example_reply: str = "Sure."
    # Files (the shared schema) whose user prompts the examples are drawn from, every evaluation prompt left out
    # (a chat-only pool for chat-like prompts, say); null = the dataset's own user prompts.
    example_paths: list[str] | None = None
    # A prompt that has not ended within this many tokens is dropped.
    max_prompt_tokens: int = 160
    min_chars: int = 12
    # Two prompts whose word-pair (2-gram) sets have at least this Jaccard similarity count as one.
    near_duplicate_jaccard: float = 0.7
    # Rows decoding at once.
    batch_size: int = 1024
    # User turns the target writes after answering each self-prompted conversation, one per round, each answered
    # in turn (0 = one-turn conversations). A conversation whose follow-up is dropped stays shorter.
    follow_up_turns: int = 0
    # Share of self-prompted conversations that get follow-ups (chosen by the seed and the conversation's id, so a
    # larger share keeps the conversations a smaller one chose).
    follow_up_fraction: float = 1.0


@dataclass
class VllmConfig:
    """vLLM backend settings (extract.backend=vllm): an engine eaglet starts, or a server at `url`."""

    # A running vLLM server (http://host:8000); null = start the engine in this process.
    url: str | None = None
    # null = hardware.devices.
    tensor_parallel_size: int | None = None
    # null = on for mixture-of-experts targets on more than one GPU.
    enable_expert_parallel: bool | None = None
    gpu_memory_utilization: float = 0.85
    # null = extract.max_length + 1 (the prompt plus the one token vLLM generates).
    max_model_len: int | None = None
    # Where vLLM writes one safetensors file per request; the server must see the same path.
    # null = ${paths.data_dir}/vllm_requests/<model>/<dataset>.
    storage_dir: str | None = None
    # Server mode: requests in flight, seconds per request, retries (with backoff) per request.
    concurrency: int = 16
    request_timeout_s: float = 600.0
    max_retries: int = 3
    # Compare eaglet's tokenization of each conversation with vLLM's own; mismatches are skipped and counted.
    check_tokenization: bool = True
    # Keep vLLM's per-request files after they are converted into shards.
    keep_request_files: bool = False


@dataclass
class ExtractConfig:
    """Hidden-state extraction into shards."""

    backend: ExtractBackend = ExtractBackend.transformers
    # Shard folder; null = ${paths.data_dir}/<model>/<dataset>.
    output_dir: str | None = None
    max_length: int = 2048
    # Padded tokens per forward batch (sequences are length-bucketed to keep padding low).
    batch_tokens: int = 16384
    # Tokens per shard file.
    shard_tokens: int = 65536
    dtype: FloatDtype = FloatDtype.bfloat16
    # hidden_states: shards of the target's features (trainer.features=shards); tokens: token streams and token
    # counts only, 5 bytes a token, into ${paths.data_dir}/tokens/<model>/<dataset> (trainer.features=online).
    features: ExtractFeatures = ExtractFeatures.hidden_states
    # Bounded disk (trainer.features=window): the shard folder never holds more than this many GB (1e9 bytes):
    # shards, those being written, the target head, token counts and manifests. Before each shard, extraction
    # waits until training (`python train.py trainer.features=window`, run beside it) has deleted enough shards it
    # finished with. null = no bound: the whole folder is written (checked against the free disk first).
    max_disk_gb: float | None = None
    # With max_disk_gb: seconds extraction waits for training to free room before it stops (the same command
    # then resumes it).
    window_timeout_s: float = 3600.0
    device: str = "auto"
    overwrite: bool = False
    strict: bool = False
    # Keep at most this many conversations in total after loading; null = all.
    max_conversations: int | None = None
    # Processes that chat-template and tokenize (Python work, ~0.5M tokens/s each); null = one per core (up to
    # 16) from 4096 conversations, else 1. The samples are identical whatever the number.
    tokenize_workers: int | None = None
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    self_prompt: SelfPromptConfig = field(default_factory=SelfPromptConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)


@dataclass
class TrainerConfig:
    """Training of the draft head (KD + training-time test)."""

    ttt_steps: int = 3
    step_loss_decay: float = 1.0
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.01
    grad_clip: float = 1.0
    max_epochs: int = 1
    max_steps: int = -1
    # Seconds of training (counted across resumes) after which it ends as if done: last checkpoint, final
    # validation, report, draft folder. A time budget's safety net: the LR schedule still spans max_steps /
    # max_epochs, so set those to what the budget should reach. null = no limit.
    max_time_s: float | None = None
    # With max_time_s: the LR schedule's length refitted as the run goes to the steps its time allows at its own
    # measured step rate (validations and checkpoints included), at most max_steps / max_epochs', so that the
    # decay ends as the time does, whatever the machine's rate (eaglet.train.time_fit).
    fit_steps_to_time: bool = False
    # Tokens per optimizer step, summed over devices and accumulation; the same on every hardware.
    global_batch_tokens: int = 8192
    val_fraction: float = 0.05
    # Train on a fixed random share of the training split (by a hash of each sequence's id; validation
    # unchanged): fewer distinct sequences, repeated over more epochs, at the same tokens seen. For measuring
    # what new data buys against repeats (recipes/smollm2_scale.py's quarter_data row); 1 = all of it.
    train_fraction: float = 1.0
    # Seeds the head's initialisation and the order of its training batches alone; null: the top-level `seed`.
    # The data, the validation split and the training share stay on the top-level seed, so two runs that differ
    # here differ only by the luck of training (recipes/smollm2_scale.py's seed_mid row).
    seed: int | None = None
    val_every_n_steps: int = 50
    # last.ckpt is refreshed this often (optimizer steps), so a killed run loses little.
    checkpoint_every_n_steps: int = 50
    num_workers: int = 0
    # With num_workers 0: threads of the training process that build micro-batches ahead (0 = in the loop).
    loader_threads: int = 2
    # trainer.features=online with loader threads: the target's forward runs in the loader, on its copy stream,
    # one micro-batch ahead, so that on a GPU it overlaps the head's step instead of following it. Same
    # features, same losses (tested); off = inside the step.
    online_overlap: bool = False
    # trainer.features=online: torch.compile the target's decoder layers (fused norms, RoPE and MLP between the
    # matmuls); the same features within rounding (tested), a compilation at the start.
    online_compile: bool = False
    lm_head_trainable: bool = True
    mask_outside_draft_vocab: bool = False
    feature_noise_std: float = 0.0
    loss_chunk_tokens: int = 2048
    # TTT attention: "auto" (flex on CUDA, sdpa on CPU), "flex" (block-sparse flex_attention, CUDA only), "sdpa".
    attention: Attention = Attention.auto
    # torch.compile the draft layer's pieces (norms, projections, RoPE, MLP) and the fused loss's chunks: faster on
    # GPUs (about 1.2-1.35x the eager step at Llama and Kimi shapes on an H200), slow first steps.
    compile: bool = False
    # train/acc_k against the teacher's full-vocab argmax (an extra [T, V] matmul); validation always uses it.
    full_vocab_train_accuracy: bool = False
    # A trained head's serving folder (a run's draft/ or an export) to start from, rather than from the target's
    # rows: more steps or more data for a head trained before. Same draft settings, target and aux layers; its
    # draft vocab comes with it; a fresh optimizer and schedule. A run resuming from a checkpoint ignores it.
    init_from: str | None = None
    # dtype of the frozen embedding table ("bfloat16" halves it); null = the parameters' dtype (FSDP needs that).
    embed_dtype: FloatDtype | None = None
    # shards: read the target's features from extracted shards; online: run the frozen target (a replica per
    # device) inside each step on the token streams of `python extract.py extract.features=tokens`; window: train
    # on shards while `python extract.py extract.max_disk_gb=...` writes them, deleting each once trained on.
    features: TrainFeatures = TrainFeatures.shards
    # trainer.features=window. Epochs do not pass over the whole data: the shards come in production order and each
    # stays in a rolling window of window_shards shards for that many rounds; a round trains on the window's
    # shards, and every sequence is read in max_epochs of the rounds its shard spends in the window (all of them
    # when window_shards = max_epochs). A shard is deleted once its rounds are done and a checkpoint covers them.
    # Shard 0 is the validation set (kept to the end) unless val_fraction is 0. null = max_epochs; more shards
    # mix more of the data into each round, at the cost of disk (README: "Bounded disk").
    window_shards: int | None = None
    # trainer.features=window: seconds to wait for extraction's next shard before stopping with what to do.
    window_timeout_s: float = 3600.0


@dataclass
class EvalSetConfig:
    """A prompt set: the user turns of records [skip, skip + count) of a JSONL file in the shared schema."""

    path: str = MISSING
    skip: int = 0
    count: int = 20
    description: str = ""


def _default_server_roles() -> list[ServerRole]:
    return [ServerRole.greedy, ServerRole.eaglet, ServerRole.ngram]


@dataclass
class EvalServerConfig:
    """Evaluation through a serving engine (eval.backend=vllm_server|sglang_server): eaglet connects to running
    servers (`url`, ...) or starts one server per role in `launch`, one after another, on `host`:`port`."""

    # Connect: the server that drafts with the trained head (http://host:8000); null = launch servers.
    url: str | None = None
    # Connect, optional: a server with n-gram lookup, and one without speculation (the greedy reference of the
    # lossless check and the speed baseline).
    ngram_url: str | None = None
    greedy_url: str | None = None
    # Launch: the servers to start, in order (greedy, eaglet, ngram; baseline = eval.baseline_draft).
    launch: list[ServerRole] = field(default_factory=_default_server_roles)
    # The target the engine serves; null = model.path.
    model: str | None = None
    # The program before the engine's arguments; null = `vllm serve` / `python -m sglang.launch_server`.
    executable: list[str] | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    # null = hardware.devices.
    tensor_parallel_size: int | None = None
    # More engine arguments, appended as given (e.g. [--max-model-len, "8192"]).
    extra_args: list[str] = field(default_factory=list)
    # Seconds a launched server may take to answer /health (large targets load for many minutes).
    startup_timeout_s: float = 1800.0
    request_timeout_s: float = 600.0
    # Server logs; null = <run>/server_logs.
    log_dir: str | None = None


@dataclass
class EvalConfig:
    """Speculative decoding against the real target: the trained head beside n-gram lookup."""

    # A training run folder (outputs/train/<time>); null or "last" = the newest one.
    run: str | None = None
    sets: list[str] = field(default_factory=lambda: ["mt_bench_like", "code", "math"])
    num_spec_tokens: int = 4
    max_new_tokens: int = 128
    # Cap on prompts per set (null = the set's count).
    prompts_per_set: int | None = None
    ngram_min_n: int = 1
    ngram_max_n: int = 4
    # Another draft to compare, in the EAGLE format (a folder with config.json + model.safetensors).
    baseline_draft: str | None = None
    # in_process: load the target here (eval.device); vllm_server / sglang_server: through a serving engine.
    backend: EvalBackend = EvalBackend.in_process
    server: EvalServerConfig = field(default_factory=EvalServerConfig)
    device: str = "auto"
    # Processes that evaluate prompts side by side (eval.backend=in_process), each with its own copy of the target
    # (on several GPUs, spread over them). One prompt's decoding keeps a GPU mostly idle (kernel launches and
    # Python bound it), so on a GPU N processes go ~N times as fast until the GPU or the cores are busy; on a
    # CPU, keep 1 (the cores are already shared). Counts are those of one process.
    workers: int = 1
    # bf16 targets may round a K+1-token verification differently from a 1-token step: top-2 logit gaps
    # below this count as near-ties instead of failing the lossless check. 0 = exact (fp32).
    tie_tolerance: float = 0.0
    # Also score each EAGLE head at every position of the greedy answers, as validation does (acc_k, tau_sim):
    # near val/acc_k on prompts like the training ones but not on these, the prompts differ, not the features
    # (eaglet.evaluate.positions). Its cost grows with the square of max_new_tokens.
    position_accuracy: bool = False
    # Prompt sets by name, each an EvalSetConfig. A plain mapping here, so that a new set can be added from
    # the command line (+eval.set_defs.z.path=/x.jsonl); each entry is checked after composition
    # (eaglet.config.eval_sets).
    set_defs: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExportConfig:
    """Re-export a trained run's head for serving."""

    # A training run folder; null or "last" = the newest one.
    run: str | None = None
    # "eagle" (vLLM and SGLang) or "speculators" (vLLM and the speculators package).
    format: ExportFormat = ExportFormat.eagle
    # null = <run>/export-<format>
    out_dir: str | None = None
    overwrite: bool = False
    # speculators records the target it drafts for; null = model.path (the target's folder or hub id).
    verifier_name_or_path: str | None = None


@dataclass
class WandbConfig:
    """Weights & Biases tracking; offline unless wandb has credentials for its server (WANDB_MODE wins when set).

    conf/logger/wandb.yaml reads these; evaluation and sweep summaries write to the W&B run a folder records.
    """

    project: str = "eaglet"
    entity: str | None = None
    # null = the sweep folder's name for multiruns, none for single runs.
    group: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class PathsConfig:
    """Where eaglet reads and writes."""

    # Root of the shared prompt data; the dataset files refer to it.
    shared_data: str = MISSING
    # Derived data (regenerated conversations, shards) and converted weights.
    data_dir: str = MISSING
    cache_dir: str = MISSING
    output_dir: str = MISSING
    # The training run's folder, set by training itself (Hydra's output folder, or the folder of the run a
    # checkpoint resumes); conf/callbacks and conf/logger write there through ${paths.run_dir}.
    run_dir: str | None = None


@dataclass
class PlanServingConfig:
    """The serving side of the planner: decode batch, context, and the acceptance curve."""

    # Concurrent sequences per decode step, and mean tokens already in each one's KV cache.
    batch_size: int = 1
    context_tokens: int = 4096
    # Devices one served replica spans (tensor parallel); null = every device of a node.
    tensor_parallel_size: int | None = None
    # Draft lengths 1..max_draft_length are tabulated.
    max_draft_length: int = 8
    # Assumed acceptance: per draft position, the chance it is accepted given all earlier ones were; the
    # last value repeats for longer drafts.
    acceptance: list[float] = field(default_factory=lambda: [0.74])
    # A measured curve instead: eval.json of a run (or any JSON with "acceptance_rates" per position).
    acceptance_from: str | None = None
    # Which proposer of an eval.json to read.
    proposer: str = "eaglet"


@dataclass
class PlanCalibrationConfig:
    """Efficiency factors and link costs of the planner; conf/plan/default.yaml names the measurement of each."""

    training_efficiency: float = MISSING
    # The same with trainer.compile=true (the layer's pieces and the loss chunks through torch.compile).
    training_efficiency_compiled: float = MISSING
    # Share of datasheet memory bandwidth reached by the training loss's element-wise passes.
    training_bandwidth_efficiency: float = MISSING
    # Keys a training attention query visits on GPUs: "row" (the whole packed micro-batch) or "document".
    training_attention: AttentionKeys = MISSING
    # GPU time per TTT step outside the FLOPs and the loss's bytes (a narrow head's many small kernels): per
    # packed token (µs) and per micro-batch (ms).
    training_token_step_us: float = MISSING
    training_microbatch_step_ms: float = MISSING
    # Share of datasheet bf16 reached by the target's forward over packed extraction batches.
    prefill_efficiency: float = MISSING
    # Extraction: one replica's storing rate when the filesystem costs nothing (tmpfs), GB/s.
    host_store_gbs: float = MISSING
    # Extraction: share of the storing time the forward still waits for (storing runs beside it).
    store_exposed_share: float = MISSING
    # Shard disk write rate (GB/s, with fsync) where the hardware config gives none.
    disk_write_gbs: float = MISSING
    # Decode (regeneration, serving): shares of datasheet bandwidth and bf16 one decode step reaches.
    decode_bandwidth_efficiency: float = MISSING
    decode_compute_efficiency: float = MISSING
    # Regeneration end to end: the share of its decode steps' rate the whole loop reaches.
    regeneration_loop_efficiency: float = MISSING
    pcie_allreduce_share: float = MISSING
    pcie_allreduce_model: str = MISSING
    pcie_allreduce_hardware: str = MISSING
    pcie_allreduce_batch_size: int = MISSING
    nvlink_allreduce_us: float = MISSING


@dataclass
class PlanQualityConfig:
    """plan.py's "what more training buys": τ of measured heads against log2 of the tokens they trained on."""

    # scale.json files (recipes/smollm2_scale.py) or evaluated run folders (eval.json + report.json);
    # empty = the section is off.
    measured: list[str] = field(default_factory=list)
    # Tokens a continued head (trainer.init_from) had seen before its own run, as "label=tokens" entries; the
    # label is the run folder as given in `measured`, or <scale.json path>:<row>.
    tokens_before: list[str] = field(default_factory=list)
    # The goal τ of a set: goal_ratio × the baseline proposer's τ in the same evaluations.
    goal_ratio: float = 1.5
    proposer: str = "eaglet"
    baseline: str = "ngram"


@dataclass
class PlanConfig:
    """plan.py: disk, regeneration, extraction, training and serving estimates for model x data x hardware."""

    # Hardware configs side by side (names under conf/hardware/); empty = the composed `hardware` only.
    compare: list[str] = field(default_factory=list)
    # Data you may not have yet: tokens in total, or conversations (tokens per conversation estimated from
    # the dataset files when readable, else from tokens_per_conversation).
    tokens: int | None = None
    conversations: int | None = None
    tokens_per_conversation: float | None = None
    # Estimating tokens from text: characters per token, and template tokens added per turn.
    chars_per_token: float = 4.0
    template_tokens_per_turn: int = 6
    # "Finishes in under a day": the deadline of the one-line answer.
    deadline_hours: float = 24.0
    # Concurrent sequences while regenerating answers with the target.
    regenerate_batch_size: int = 256
    # Share of device memory the target's weights may fill (the rest: KV cache, activations).
    weight_memory_fraction: float = 0.85
    # Shard dtypes to size.
    dtypes: list[FloatDtype] = field(default_factory=lambda: [FloatDtype.bfloat16, FloatDtype.float32])
    serving: PlanServingConfig = field(default_factory=PlanServingConfig)
    calibration: PlanCalibrationConfig = field(default_factory=PlanCalibrationConfig)
    quality: PlanQualityConfig = field(default_factory=PlanQualityConfig)


@dataclass
class SweepConfig:
    """One sweep trial (the files under sweeps/ turn it on): train, then measure the head at every draft length."""

    enabled: bool = False
    # Serving draft lengths 1..max_draft_length are measured, whatever trainer.ttt_steps the head trained with.
    max_draft_length: int = 8
    # Where the τ the objective reads comes from: "decode" = speculative decoding against the target on the
    # eval prompt sets (eval.sets, eval.prompts_per_set, eval.max_new_tokens); "sim" = the simulated τ of
    # the validation shards (no target needed). The simulated curve is recorded either way.
    tau_source: TauSource = TauSource.decode
    # The value a trial returns to the sweeper: "speedup" (predicted, at its best draft length) or "tau"
    # (at max_draft_length).
    objective: SweepObjective = SweepObjective.speedup
    # The deployment the speedup is predicted for: names under conf/model and conf/hardware. null = this
    # run's model; this run's hardware, or h200_x1 when it has no datasheet numbers (hardware=cpu).
    serve_model: str | None = None
    serve_hardware: str | None = None


@dataclass
class EagletConfig:
    """The composed config of every entry point."""

    model: ModelConfig = field(default_factory=ModelConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    # The one seed: training (initialisation and data order unless trainer.seed, the validation split),
    # regeneration sampling, the vLLM engine, and the Optuna sampler of sweeps/optuna_tau.yaml.
    seed: int = 0
    ckpt_path: str | None = None
    # Lightning callbacks and loggers of a training run, by name: each entry a `_target_` (a class or function
    # to import) and its keyword arguments, built by Hydra (conf/callbacks/, conf/logger/). null switches one
    # off. Plain mappings, so that `+callbacks.<name>._target_=...` adds one; eaglet.config.targets checks them.
    callbacks: dict[str, Any] = field(default_factory=dict)
    logger: dict[str, Any] = field(default_factory=dict)
