"""Checks across keys and value ranges, run once on the composed config by every entry point.

Types, unknown keys and closed choices fail earlier, at composition (eaglet.config.schema). What is left
needs no data, no files and no device: a wrong setting fails here, naming its key, before any work starts.
Checks that depend on one stage's inputs stay in that stage (the shards' manifest, the machine's GPUs, the
training batch on the training hardware, the planner's datasheet numbers), and so do the sweep trial's own
settings (a sweep records a wrong one as a failed trial).
"""

from __future__ import annotations

from omegaconf import OmegaConf

from eaglet.config.bounds import at_least, positive, within
from eaglet.config.choices import STRATEGIES, EvalBackend, ExtractBackend, ExtractFeatures, TrainFeatures
from eaglet.config.eval_sets import eval_set_defs
from eaglet.config.schema import (
    DatasetConfig,
    DraftConfig,
    EagletConfig,
    EvalConfig,
    EvalServerConfig,
    ExtractConfig,
    HardwareConfig,
    ModelConfig,
    PlanConfig,
    TrainerConfig,
)
from eaglet.config.window import check_window
from eaglet.errors import ConfigError

# Lightning's seed_everything (and numpy) take seeds in [0, 2**32 - 1].
MAX_SEED = 2**32 - 1


def check_config(cfg: EagletConfig) -> None:
    """Raise ConfigError, naming the key, at the first setting no stage can run with."""
    within("", {"seed": cfg.seed}, f"[0, {MAX_SEED}]")
    check_model(cfg.model)
    check_draft(cfg.draft, cfg.model)
    check_trainer(cfg.trainer)
    check_hardware(cfg.hardware, cfg.trainer)
    check_dataset(cfg.dataset)
    check_extract(cfg.extract)
    check_window(cfg)
    check_eval(cfg.eval)
    check_plan(cfg.plan)


def check_model(model: ModelConfig) -> None:
    unset = sorted(OmegaConf.missing_keys(model)) if OmegaConf.is_config(model) else []
    if unset:
        name = "your model" if "name" in unset else f"model={model.name}"
        raise ConfigError(
            f"{name} leaves {', '.join(f'model.{key}' for key in unset)} unset: set them in its file under "
            "conf/model/ (the target's config.json has the dimensions)"
        )
    dims = (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
        "weight_bits",
        "dense_weight_bits",
    )
    at_least("model", {key: getattr(model, key) for key in dims}, 1)
    sparse = (
        "num_experts",
        "num_experts_per_tok",
        "num_shared_experts",
        "moe_intermediate_size",
        "first_k_dense_replace",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "v_head_dim",
        "total_params_b",
        "active_params_b",
    )
    at_least("model", {key: getattr(model, key) for key in sparse}, 0, hint=" (0 = not used)")
    positive("model", {"rms_norm_eps": model.rms_norm_eps, "rope_theta": model.rope_theta})
    if model.num_experts_per_tok > model.num_experts:
        raise ConfigError(
            f"model.num_experts_per_tok={model.num_experts_per_tok} exceeds model.num_experts="
            f"{model.num_experts}: a token cannot be routed to more experts than the target has"
        )


def check_draft(draft: DraftConfig, model: ModelConfig) -> None:
    unset = sorted(OmegaConf.missing_keys(draft)) if OmegaConf.is_config(draft) else []
    if unset:
        raise ConfigError(
            f"model={model.name} has no draft head ({', '.join(f'draft.{key}' for key in unset)} unset): add "
            f"conf/draft/{model.name}.yaml, or take a shipped shape with draft=<name> (conf/draft/)"
        )
    dims = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
    at_least("draft", {key: getattr(draft, key) for key in dims}, 1)
    at_least("draft", {"vocab_size": draft.vocab_size}, 1)  # below 1 is not a size at all
    at_least(
        "draft",
        {"vocab_size": draft.vocab_size},
        2,
        hint=": a one-token draft vocabulary cannot draft (every proposal is that token, so training reports "
        "loss 0 and accuracy 1.0 and learns nothing); draft heads use thousands, e.g. draft.vocab_size=32000",
    )
    at_least("draft", {"max_position_embeddings": draft.max_position_embeddings}, 1)
    positive("draft", {"rms_norm_eps": draft.rms_norm_eps, "rope_theta": draft.rope_theta})
    if draft.num_attention_heads % draft.num_key_value_heads:
        raise ConfigError(
            f"draft.num_attention_heads={draft.num_attention_heads} is not a multiple of "
            f"draft.num_key_value_heads={draft.num_key_value_heads}; pick a divisor"
        )
    if draft.head_dim % 2:
        raise ConfigError(f"draft.head_dim={draft.head_dim} must be even for rotary embeddings")
    if draft.hidden_size != model.hidden_size:
        raise ConfigError(
            f"draft.hidden_size={draft.hidden_size} must equal the target's hidden size "
            f"model.hidden_size={model.hidden_size}: the head reuses the target's embeddings and lm_head rows"
        )


def check_trainer(tr: TrainerConfig) -> None:
    counts = {
        "ttt_steps": tr.ttt_steps,
        "loss_chunk_tokens": tr.loss_chunk_tokens,
        "max_epochs": tr.max_epochs,
        "global_batch_tokens": tr.global_batch_tokens,
        "val_every_n_steps": tr.val_every_n_steps,
        "checkpoint_every_n_steps": tr.checkpoint_every_n_steps,
    }
    at_least("trainer", counts, 1)
    at_least("trainer", {"num_workers": tr.num_workers, "loader_threads": tr.loader_threads}, 0)
    if tr.max_steps != -1 and tr.max_steps < 1:
        raise ConfigError(
            f"trainer.max_steps must be -1 (trainer.max_epochs decides) or >= 1, got {tr.max_steps}"
        )
    positive("trainer", {"lr": tr.lr}, hint=" (the peak learning rate, e.g. trainer.lr=3e-4)")
    positive("trainer", {"max_time_s": tr.max_time_s}, hint=" (seconds of training; null = no limit)")
    positive("trainer", {"step_loss_decay": tr.step_loss_decay})
    at_least("trainer", {"weight_decay": tr.weight_decay, "feature_noise_std": tr.feature_noise_std}, 0)
    at_least("trainer", {"grad_clip": tr.grad_clip}, 0, hint=" (0 = no clipping)")
    within(
        "trainer", {"warmup_ratio": tr.warmup_ratio}, "[0, 1)", hint=" (the share of steps spent warming up)"
    )
    within("trainer", {"val_fraction": tr.val_fraction}, "[0, 1)", hint=" (0 = no validation)")
    within("trainer", {"train_fraction": tr.train_fraction}, "(0, 1]", hint=" (1 = every training sequence)")
    if tr.train_fraction < 1 and tr.features == TrainFeatures.window:
        raise ConfigError(
            f"trainer.train_fraction={tr.train_fraction} takes a share of the whole training split, which window "
            "training never holds at once: use trainer.features=shards or online, or trainer.train_fraction=1"
        )
    if tr.seed is not None and tr.features == TrainFeatures.window:
        raise ConfigError(
            f"trainer.seed={tr.seed}: window training reads its batches in the order its extraction schedule "
            "fixed (the top-level seed), so a training seed alone cannot reorder them: use trainer.features=shards "
            "or online, or trainer.seed=null"
        )
    if tr.online_overlap and (tr.features != TrainFeatures.online or tr.num_workers or not tr.loader_threads):
        raise ConfigError(
            "trainer.online_overlap=true runs the target in the loader's threads of online training: it needs "
            f"trainer.features=online (got {tr.features.value}), trainer.num_workers=0 (got {tr.num_workers}) and "
            f"trainer.loader_threads >= 1 (got {tr.loader_threads})"
        )
    if tr.fit_steps_to_time and tr.max_time_s is None:
        raise ConfigError(
            "trainer.fit_steps_to_time=true fits the learning-rate schedule to trainer.max_time_s, which is not "
            "set: give the run its time (trainer.max_time_s=<seconds>) or drop trainer.fit_steps_to_time"
        )
    if tr.fit_steps_to_time and tr.features == TrainFeatures.window:
        raise ConfigError(
            "trainer.fit_steps_to_time=true cannot size window training (trainer.features=window), whose length is "
            "its rounds over the shards: use trainer.features=offline or online, or drop trainer.fit_steps_to_time"
        )
    if tr.online_compile and tr.features != TrainFeatures.online:
        raise ConfigError(
            "trainer.online_compile=true compiles the target that online training runs: it needs "
            f"trainer.features=online (got {tr.features.value}); trainer.compile=true compiles the head"
        )


def check_hardware(hw: HardwareConfig, tr: TrainerConfig) -> None:
    at_least("hardware", {"devices": hw.devices, "num_nodes": hw.num_nodes}, 1)
    at_least("hardware", {"tokens_per_device": hw.tokens_per_device}, 1)
    datasheet = (
        "memory_gb_per_device",
        "bf16_tflops",
        "memory_bandwidth_gbs",
        "interconnect_bandwidth_gbs",
        "disk_tb",
        "disk_write_gbs",
        "cpu_cores",
        "slurm_time_min",
        "slurm_gpus_per_node",
    )
    at_least("hardware", {key: getattr(hw, key) for key in datasheet}, 0, hint=" (0 = unknown)")
    if hw.strategy not in STRATEGIES:
        raise ConfigError(
            f"strategy={hw.strategy!r} is not one of {', '.join(STRATEGIES)} (hardware.strategy)"
        )
    if hw.strategy == "fsdp" and tr.embed_dtype is not None:
        raise ConfigError(
            f"trainer.embed_dtype={tr.embed_dtype} cannot be combined with hardware.strategy=fsdp (FSDP flattens "
            "each unit into one dtype); leave trainer.embed_dtype=null"
        )
    if hw.strategy == "fsdp" and hw.accelerator != "gpu":
        raise ConfigError(
            f"hardware.strategy=fsdp needs GPUs (Lightning's FSDP has no CPU backend); hardware={hw.name} is "
            f"accelerator={hw.accelerator}: use hardware.strategy=ddp there"
        )


def check_dataset(dataset: DatasetConfig) -> None:
    # dataset.paths may stay unset (dataset=jsonl) for stages that read no data; eaglet.data.dataset asks for it.
    if not OmegaConf.is_missing(dataset, "paths") and not dataset.paths:
        raise ConfigError(f"dataset.paths is empty (dataset={dataset.name}): list its JSONL files")
    at_least("dataset", {"max_records_per_file": dataset.max_records_per_file}, 1, hint=" (null = all)")


def check_extract(ext: ExtractConfig) -> None:
    sizes = {
        "max_length": ext.max_length,
        "batch_tokens": ext.batch_tokens,
        "shard_tokens": ext.shard_tokens,
        "max_conversations": ext.max_conversations,
        "tokenize_workers": ext.tokenize_workers,
    }
    at_least("extract", sizes, 1)
    sp = ext.self_prompt
    at_least("extract.self_prompt", {"num_prompts": sp.num_prompts}, 0, hint=" (0 = none)")
    at_least(
        "extract.self_prompt", {"max_prompt_tokens": sp.max_prompt_tokens, "batch_size": sp.batch_size}, 1
    )
    at_least(
        "extract.self_prompt",
        {"min_chars": sp.min_chars, "follow_up_turns": sp.follow_up_turns, "examples": sp.examples},
        0,
    )
    positive("extract.self_prompt", {"temperature": sp.temperature}, hint=" (prompts are sampled)")
    within(
        "extract.self_prompt",
        {"top_p": sp.top_p, "near_duplicate_jaccard": sp.near_duplicate_jaccard},
        "(0, 1]",
    )
    within("extract.self_prompt", {"follow_up_fraction": sp.follow_up_fraction}, "[0, 1]")
    regen = ext.regenerate
    counts = {
        "max_new_tokens": regen.max_new_tokens,
        "batch_size": regen.batch_size,
        "refill_every": regen.refill_every,
        "concurrency": regen.concurrency,
        "samples_per_prompt": regen.samples_per_prompt,
    }
    at_least("extract.regenerate", counts, 1)
    at_least("extract.regenerate", {"max_retries": regen.max_retries}, 0)
    at_least("extract.regenerate", {"temperature": regen.temperature}, 0, hint=" (0 = greedy)")
    within("extract.regenerate", {"top_p": regen.top_p}, "(0, 1]", hint=" (1 = no nucleus cut)")
    positive("extract.regenerate", {"request_timeout_s": regen.request_timeout_s})
    if regen.samples_per_prompt > 1:
        positive(
            "extract.regenerate", {"sample_temperature": regen.sample_temperature}, hint=" (sampled answers)"
        )
        within(
            "extract.regenerate", {"sample_top_p": regen.sample_top_p}, "(0, 1]", hint=" (1 = no nucleus cut)"
        )
        at_least("extract.regenerate", {"sampled_conversations": regen.sampled_conversations}, 1)
    vllm = ext.vllm
    counts = {
        "tensor_parallel_size": vllm.tensor_parallel_size,
        "max_model_len": vllm.max_model_len,
        "concurrency": vllm.concurrency,
    }
    at_least("extract.vllm", counts, 1)
    at_least("extract.vllm", {"max_retries": vllm.max_retries}, 0)
    within("extract.vllm", {"gpu_memory_utilization": vllm.gpu_memory_utilization}, "(0, 1]")
    positive("extract.vllm", {"request_timeout_s": vllm.request_timeout_s})
    if (
        ext.backend == ExtractBackend.vllm
        and vllm.max_model_len is not None
        and vllm.max_model_len <= ext.max_length
    ):
        raise ConfigError(
            f"extract.vllm.max_model_len={vllm.max_model_len} must exceed extract.max_length={ext.max_length} "
            "(the prompt plus the one generated token); raise it or leave it null"
        )
    if ext.features == ExtractFeatures.tokens and ext.backend != ExtractBackend.transformers:
        raise ConfigError(
            f"extract.features=tokens needs extract.backend=transformers (got {ext.backend}): online training runs "
            "the target in the training process, which a target served through vLLM is too large for; extract "
            "hidden states (extract.features=hidden_states) and train from shards, or regenerate through a server "
            "with extract.regenerate.endpoint=... and extract.backend=transformers"
        )


def check_eval(ev: EvalConfig) -> None:
    set_defs = eval_set_defs(ev)
    for name in ev.sets:
        if name not in set_defs:
            raise ConfigError(
                f"eval.sets names {name!r}, which is not one of {sorted(set_defs)} (eval.set_defs); add it "
                f"with +eval.set_defs.{name}.path=/data/prompts.jsonl"
            )
    counts = {
        "num_spec_tokens": ev.num_spec_tokens,
        "max_new_tokens": ev.max_new_tokens,
        "ngram_min_n": ev.ngram_min_n,
    }
    counts["workers"] = ev.workers
    at_least("eval", counts, 1)
    if ev.workers > 1 and ev.backend != EvalBackend.in_process:
        raise ConfigError(
            f"eval.workers={ev.workers} applies to eval.backend=in_process; with eval.backend={ev.backend.value} "
            "a serving engine decodes the prompts; drop eval.workers (1)"
        )
    at_least("eval", {"prompts_per_set": ev.prompts_per_set}, 1, hint=" (null = each set's count)")
    if ev.ngram_max_n < ev.ngram_min_n:
        raise ConfigError(f"eval.ngram_max_n={ev.ngram_max_n} must be >= eval.ngram_min_n={ev.ngram_min_n}")
    at_least("eval", {"tie_tolerance": ev.tie_tolerance}, 0, hint=" (0 = exact)")
    check_eval_server(ev.server, ev)


def check_eval_server(server: EvalServerConfig, ev: EvalConfig) -> None:
    urls = {"url": server.url, "ngram_url": server.ngram_url, "greedy_url": server.greedy_url}
    if ev.backend == EvalBackend.in_process:
        given = sorted(key for key, url in urls.items() if url)
        if given:
            raise ConfigError(
                f"eval.server.{given[0]} is set but eval.backend=in_process loads the target in this process; "
                "pass eval.backend=vllm_server (or sglang_server) to evaluate through that server"
            )
        return
    for key, url in urls.items():
        if url and not str(url).startswith(("http://", "https://")):
            raise ConfigError(f"eval.server.{key}={url!r}: expected http://host:port")
    if not server.url:
        extra = sorted(key for key in ("ngram_url", "greedy_url") if urls[key])
        if extra:
            raise ConfigError(
                f"eval.server.{extra[0]} is set without eval.server.url (the server drafting with the head): "
                "give all the servers to connect to, or none and eaglet starts them (eval.server.launch)"
            )
        roles = [str(role) for role in server.launch]
        if not roles:
            raise ConfigError(
                "eval.server.launch is empty and eval.server.url is unset: list the servers eaglet starts, "
                "e.g. eval.server.launch=[greedy,eaglet,ngram]"
            )
        twice = sorted({role for role in roles if roles.count(role) > 1})
        if twice:
            raise ConfigError(f"eval.server.launch lists {twice} more than once; list each server once")
        if "baseline" in roles and not ev.baseline_draft:
            raise ConfigError(
                "eval.server.launch lists baseline but eval.baseline_draft is unset: give the other head's "
                "EAGLE folder, or leave baseline out"
            )
        if server.executable is not None and not server.executable:
            raise ConfigError(
                "eval.server.executable is empty: give the program that starts the engine, e.g. [vllm, serve], "
                "or null for the engine's own"
            )
    within("eval.server", {"port": server.port}, "[1, 65535]")
    at_least(
        "eval.server",
        {"tensor_parallel_size": server.tensor_parallel_size},
        1,
        hint=" (null = hardware.devices)",
    )
    positive(
        "eval.server",
        {"startup_timeout_s": server.startup_timeout_s, "request_timeout_s": server.request_timeout_s},
    )


def check_plan(plan: PlanConfig) -> None:
    positive_keys = {
        "tokens": plan.tokens,
        "conversations": plan.conversations,
        "tokens_per_conversation": plan.tokens_per_conversation,
        "chars_per_token": plan.chars_per_token,
        "deadline_hours": plan.deadline_hours,
    }
    positive("plan", positive_keys)
    twice = sorted({name for name in plan.compare if list(plan.compare).count(name) > 1})
    if twice:
        raise ConfigError(f"plan.compare lists {twice} more than once; list each hardware once")
    at_least("plan", {"template_tokens_per_turn": plan.template_tokens_per_turn}, 0)
    at_least("plan", {"regenerate_batch_size": plan.regenerate_batch_size}, 1)
    within("plan", {"weight_memory_fraction": plan.weight_memory_fraction}, "(0, 1]")
    if not plan.dtypes:
        raise ConfigError("plan.dtypes is empty: list the shard dtypes to size, e.g. plan.dtypes=[bfloat16]")
    serving = plan.serving
    if serving.batch_size < 1 or serving.context_tokens < 0:
        raise ConfigError("plan.serving.batch_size must be >= 1 and plan.serving.context_tokens >= 0")
    at_least(
        "plan.serving",
        {"tensor_parallel_size": serving.tensor_parallel_size, "max_draft_length": serving.max_draft_length},
        1,
    )
    assumed = list(serving.acceptance)
    if not serving.acceptance_from and (not assumed or any(not 0.0 <= a <= 1.0 for a in assumed)):
        raise ConfigError(
            f"plan.serving.acceptance must be a non-empty list of values in [0, 1], got {assumed}"
        )
    cal = plan.calibration
    shares = (
        "training_efficiency",
        "training_efficiency_compiled",
        "training_bandwidth_efficiency",
        "prefill_efficiency",
        "decode_bandwidth_efficiency",
        "decode_compute_efficiency",
        "regeneration_loop_efficiency",
    )
    for key in shares:
        if not 0 < getattr(cal, key) <= 1:
            raise ConfigError(f"plan.calibration.{key} must lie in (0, 1], got {getattr(cal, key)}")
    if not 0.0 <= cal.pcie_allreduce_share < 1.0:
        raise ConfigError(
            f"plan.calibration.pcie_allreduce_share must lie in [0, 1), got {cal.pcie_allreduce_share}"
        )
    positive("plan.calibration", {"host_store_gbs": cal.host_store_gbs, "disk_write_gbs": cal.disk_write_gbs})
    at_least("plan.calibration", {"pcie_allreduce_batch_size": cal.pcie_allreduce_batch_size}, 1)
    at_least("plan.calibration", {"nvlink_allreduce_us": cal.nvlink_allreduce_us}, 0)
    at_least("plan.calibration", {"store_exposed_share": cal.store_exposed_share}, 0)
    small_kernels = {
        "training_token_step_us": cal.training_token_step_us,
        "training_microbatch_step_ms": cal.training_microbatch_step_ms,
    }
    at_least("plan.calibration", small_kernels, 0)
