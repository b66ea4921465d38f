"""The tensor names vLLM and SGLang load from an EAGLE-format file: vLLM's renaming replayed, SGLang's
constraint checked, so a name one server would drop or misplace fails at export rather than at serving."""

from __future__ import annotations

from collections.abc import Iterable

from eaglet.errors import DataError
from eaglet.formats.speculators import EAGLE_LAYER_PREFIX, LAYER_PREFIX

# vLLM's Eagle3LlamaForCausalLM parameters an EAGLE file loads into, with the shards of its stacked ones.
VLLM_PARAMS: dict[str, tuple[str | int, ...]] = {
    "model.embed_tokens.weight": (),
    "model.fc.weight": (),
    "model.layers.0.input_layernorm.weight": (),
    "model.layers.0.hidden_norm.weight": (),
    "model.layers.0.self_attn.qkv_proj.weight": ("q", "k", "v"),
    "model.layers.0.self_attn.o_proj.weight": (),
    "model.layers.0.post_attention_layernorm.weight": (),
    "model.layers.0.mlp.gate_up_proj.weight": (0, 1),
    "model.layers.0.mlp.down_proj.weight": (),
    "model.norm.weight": (),
    "lm_head.weight": (),
    "draft_id_to_target_id": (),
}
_STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def _vllm_target(name: str) -> tuple[str, str | int | None] | None:
    """(parameter, shard) vLLM loads `name` into; None for names it drops (t2d)."""
    if name == "t2d":
        return None
    if name == "d2t":
        return "draft_id_to_target_id", None
    param = (
        name if name.startswith("lm_head.") else "model." + name.replace(EAGLE_LAYER_PREFIX, LAYER_PREFIX, 1)
    )
    for part, (stacked, shard) in _STACKED.items():
        if part in param:
            return param.replace(part, stacked), shard
    return param, None


def eagle_server_names(
    names: Iterable[str], *, vocab_size: int, draft_vocab_size: int
) -> dict[str, str | None]:
    """Map each tensor name of an EAGLE-format file to the vLLM parameter it loads into; fail on any name a
    server would drop, misplace or miss.

    vLLM (`Eagle3LlamaForCausalLM.load_weights` in `llama_eagle3.py`): drops names containing `t2d`; renames
    `d2t` to the top-level `draft_id_to_target_id`; keeps `lm_head.*`; prefixes every other name with
    `model.`; then its `LlamaModel.load_weights` replaces `midlayer.` by `layers.0.`, stacks `q/k/v_proj` into
    `qkv_proj` (shards q, k, v) and `gate/up_proj` into `gate_up_proj` (shards 0, 1), and looks the result up
    among its parameters: an unknown name raises, but a missing one goes unnoticed (no `d2t` silently keeps the
    identity map; no `embed_tokens` shares the target's, which is fine).
    SGLang (`LlamaForCausalLMEagle3.load_weights`) names the layer `midlayer` itself, turns `d2t` into its hot
    token ids, drops `t2d`, and silently skips every name it does not know. So a file both serve uses the
    `midlayer.` names without a `model.` prefix: a `layers.0.` or `model.` name loads in one server and is
    skipped (random weights) or fails in the other.

    Returns {file name: "param" or "param[shard]", or None for t2d}. `embed_tokens` is optional; `d2t` is
    required when the draft vocab is smaller than the target's.
    """
    mapping: dict[str, str | None] = {}
    loaded: dict[str, set] = {}
    problems = []
    for name in sorted(names):
        if name.startswith("model."):
            problems.append(f"{name}: drop the `model.` prefix (vLLM would look up model.{name})")
            continue
        if name.startswith(LAYER_PREFIX):
            problems.append(
                f"{name}: name it {EAGLE_LAYER_PREFIX}{name.removeprefix(LAYER_PREFIX)} (SGLang skips it)"
            )
            continue
        target = _vllm_target(name)
        if target is None:
            mapping[name] = None
            continue
        param, shard = target
        if param not in VLLM_PARAMS or (shard is not None and shard not in VLLM_PARAMS[param]):
            problems.append(f"{name}: unknown to the servers (vLLM has no parameter {param})")
            continue
        loaded.setdefault(param, set()).add(shard)
        mapping[name] = param if shard is None else f"{param}[{shard}]"
    optional = {"model.embed_tokens.weight"}
    if draft_vocab_size == vocab_size:
        optional.add("draft_id_to_target_id")
    for param, shards in VLLM_PARAMS.items():
        missing = set(shards or (None,)) - loaded.get(param, set())
        if param in loaded or param not in optional:
            problems += [
                f"nothing loads {param}" + (f"[{s}]" if s is not None else "")
                for s in sorted(missing, key=str)
            ]
    if problems:
        raise DataError(
            f"EAGLE-format tensor names the servers would not load as intended: {'; '.join(problems)}"
        )
    return mapping
