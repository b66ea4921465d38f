"""The evaluation's prompts: each set's first user turns, rendered with the target's chat template, with every
prompt seen in training dropped and counted. In-process and server evaluation read them alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglet.config.eval_sets import eval_set_defs
from eaglet.config.schema import EagletConfig, EvalSetConfig
from eaglet.data.conversations import load_conversations
from eaglet.data.dataset import load_dataset
from eaglet.data.holdout import normalise_prompt
from eaglet.data.templating import build_prompt_ids, chat_template_variables, resolve_chat_template
from eaglet.errors import ConfigError, DataError
from eaglet.formats.folder import CONFIG_FILE, read_json_object
from eaglet.formats.reader import aux_layer_ids_of, flatten_speculators
from eaglet.run_dir import RunDir
from eaglet.target_model.capture import aux_layer_ids_out_of_range

# name: (token ids of each prompt, prompts dropped as seen in training)
PromptSets = dict[str, tuple[list[list[int]], int]]


def check_run_target(run: RunDir, cfg: EagletConfig) -> None:
    """The head must have been trained for the target being evaluated: by the run's settings, or for a head folder
    without them (an export, another trainer's head) by the head's own config."""
    settings = run.settings()
    if settings is None:
        if run.draft_dir == run.path:
            check_head_fits_target(run.path, cfg, "eval.run")
        return
    trained = settings.model
    for key in ("name", "hidden_size", "vocab_size"):
        if trained[key] != cfg.model[key]:
            raise ConfigError(
                f"{run.path} trained a head for model.{key}={trained[key]}, but this evaluation targets "
                f"model.{key}={cfg.model[key]}; pass model={trained['name']} (or another run)"
            )


def check_head_fits_target(folder: Path, cfg: EagletConfig, key: str) -> None:
    """A head folder's config against the target's: the hidden size it reads, its vocabulary, its layer ids."""
    where = folder / CONFIG_FILE
    config = flatten_speculators(read_json_object(where))
    reads = config.get("target_hidden_size", config.get("hidden_size"))
    model = cfg.model
    wrong = []
    if reads != model.hidden_size:
        wrong.append(f"it reads hidden states of size {reads}, the target's are {model.hidden_size}")
    if config.get("vocab_size") != model.vocab_size:
        wrong.append(f"its vocab_size is {config.get('vocab_size')}, the target's {model.vocab_size}")
    ids = aux_layer_ids_of(config, str(where))
    if aux_layer_ids_out_of_range(ids, model.num_layers):
        wrong.append(f"its layer ids {ids} do not all lie in the target's {model.num_layers} layers")
    if wrong:
        raise ConfigError(
            f"{key}={folder}: this head was made for another target than model={model.name} ({'; '.join(wrong)}); "
            "pass the model it was trained for, or a head trained for this one"
        )


def training_prompts(cfg: EagletConfig) -> set[str]:
    """Normalised user turns of the training dataset, to keep evaluation prompts apart from them."""
    conversations, _ = load_dataset(
        cfg.dataset,
        require_assistant=not cfg.extract.regenerate.enabled,
        strict=cfg.extract.strict,
        max_conversations=cfg.extract.max_conversations,
        held_out_sets=eval_set_defs(cfg.eval),
    )
    return {normalise_prompt(t.content) for c in conversations for t in c.turns if t.role == "user"}


def prompts_taken(cfg: EagletConfig, spec: EvalSetConfig) -> int:
    """Records a set contributes: its count, capped by eval.prompts_per_set."""
    return spec.count if cfg.eval.prompts_per_set is None else min(spec.count, cfg.eval.prompts_per_set)


def load_prompt_set(
    cfg: EagletConfig, name: str, tokenizer: Any, template: str, seen: set[str]
) -> tuple[list[list[int]], int]:
    """Token ids of the set's prompts (first user turn, generation prompt appended) and how many overlapped training."""
    set_defs = eval_set_defs(cfg.eval)
    if name not in set_defs:
        raise ConfigError(f"eval.sets names {name!r}, which is not one of {sorted(set_defs)} (eval.set_defs)")
    spec = set_defs[name]
    count = prompts_taken(cfg, spec)
    conversations, _ = load_conversations([spec.path], max_records=spec.skip + count, require_assistant=False)
    chosen = conversations[spec.skip :]
    if not chosen:
        raise DataError(
            f"prompt set {name!r}: {spec.path} has no records after the first {spec.skip}; lower eval.set_defs.{name}.skip"
        )
    prompts, overlap = [], 0
    for conv in chosen:
        first_user = next(t for t in conv.turns if t.role == "user")
        if normalise_prompt(first_user.content) in seen:
            overlap += 1
            continue
        prompts.append(build_prompt_ids(tokenizer, [first_user], chat_template=template))
    return prompts, overlap


def check_prompts_left(cfg: EagletConfig, name: str, prompts: list[list[int]], overlap: int) -> None:
    """A set whose every prompt was seen in training has nothing to evaluate: say so before decoding anything."""
    if prompts:
        return
    spec = eval_set_defs(cfg.eval)[name]
    end = spec.skip + prompts_taken(cfg, spec)
    raise DataError(
        f"prompt set {name!r}: all {overlap} prompts (records [{spec.skip}, {end}) of {spec.path}) are in the "
        f"training data (dataset={cfg.dataset.name}) and were dropped as seen in training, so nothing is left "
        f"to evaluate; nothing was written. Point eval.set_defs.{name}.skip past the records training reads, "
        f"leave {name!r} out of eval.sets, or train with dataset.holdout_eval_sets=true"
    )


def load_prompt_sets(cfg: EagletConfig, tokenizer: Any) -> PromptSets:
    """Every set of eval.sets, read and checked before any decoding: a set with nothing left stops here."""
    template = resolve_chat_template(
        tokenizer, cfg.model.chat_template, chat_template_variables(cfg.model, cfg.extract.regenerate)
    )
    seen = training_prompts(cfg)
    prompt_sets = {name: load_prompt_set(cfg, name, tokenizer, template, seen) for name in cfg.eval.sets}
    for name, (prompts, overlap) in prompt_sets.items():
        check_prompts_left(cfg, name, prompts, overlap)
    return prompt_sets
