"""What running the target costs: weight bytes, FLOPs, how many devices hold it, and its all-reduces.

Parameter counts come from the model config (total_params_b, active_params_b: model cards); the split into
routed experts and the rest comes from the dimensions, so a MoE forward over n tokens can read the weights
of the distinct experts those tokens route to.
"""

from __future__ import annotations

from eaglet.config.schema import HardwareConfig, ModelConfig
from eaglet.errors import ConfigError

ACTIVATION_BYTES = 2  # bf16 activations cross the links


def require_param_counts(model: ModelConfig) -> None:
    if model.active_params_b <= 0 or model.total_params_b <= 0:
        raise ConfigError(
            f"model '{model.name}' has no total_params_b / active_params_b: set both (billions, from its model "
            f"card) in conf/model/{model.name}.yaml or on the command line"
        )


def expected_distinct_experts(num_experts: int, experts_per_token: int, tokens: float) -> float:
    """Expected distinct experts that `tokens` independent top-k routings over E experts touch: E·(1 − (1 − k/E)^n)."""
    if num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - experts_per_token / num_experts) ** tokens)


def moe_layers(model: ModelConfig) -> int:
    return max(model.num_layers - model.first_k_dense_replace, 0) if model.num_experts else 0


def params_per_routed_expert(model: ModelConfig) -> float:
    """One routed expert of one layer: gate, up and down projections."""
    return 3.0 * model.hidden_size * model.moe_intermediate_size


def routed_params(model: ModelConfig, experts_per_layer: float) -> float:
    return moe_layers(model) * experts_per_layer * params_per_routed_expert(model)


def always_read_params(model: ModelConfig) -> float:
    """Active parameters every token reads: attention, dense and shared MLPs, lm_head."""
    return max(model.active_params_b * 1e9 - routed_params(model, model.num_experts_per_tok), 0.0)


def dense_bits(model: ModelConfig) -> int:
    return model.dense_weight_bits if model.dense_weight_bits is not None else model.weight_bits


def stored_weight_bytes(model: ModelConfig) -> float:
    """Bytes of all weights in memory (embeddings included)."""
    require_param_counts(model)
    routed = routed_params(model, model.num_experts)
    rest = max(model.total_params_b * 1e9 - routed, 0.0)
    return routed * model.weight_bits / 8 + rest * dense_bits(model) / 8


def forward_weight_bytes(model: ModelConfig, tokens: float) -> float:
    """Weight bytes one forward over `tokens` tokens reads (every device together)."""
    require_param_counts(model)
    dense = always_read_params(model) * dense_bits(model) / 8
    if not model.num_experts:
        return dense
    distinct = expected_distinct_experts(model.num_experts, model.num_experts_per_tok, tokens)
    return dense + routed_params(model, distinct) * model.weight_bits / 8


def forward_flops_per_token(model: ModelConfig, context: float = 0.0) -> float:
    """2 × active parameters, plus attention scores and values over `context` earlier tokens."""
    require_param_counts(model)
    if model.kv_lora_rank:  # MLA: scores over (nope + rope) dims, values over v_head_dim
        qk_dim = model.head_dim
        v_dim = model.v_head_dim
    else:
        qk_dim = v_dim = model.head_dim
    attention = 2.0 * model.num_layers * model.num_attention_heads * (qk_dim + v_dim) * context
    return 2.0 * model.active_params_b * 1e9 + attention


def kv_cache_bytes_per_token(model: ModelConfig) -> float:
    """bf16 KV cache of one token over all layers (MLA caches the latent and the rope key)."""
    if model.kv_lora_rank:
        per_layer = model.kv_lora_rank + model.qk_rope_head_dim
    else:
        per_layer = 2 * model.num_key_value_heads * model.head_dim
    return 2.0 * per_layer * model.num_layers


def devices_per_replica(
    model: ModelConfig, hardware: HardwareConfig, weight_memory_fraction: float
) -> int | None:
    """Smallest power-of-two tensor-parallel group whose memory holds the weights; None if the machine cannot.
    A machine of unknown memory (memory_gb_per_device 0, e.g. cpu) is taken to hold it on one device."""
    world = hardware.devices * hardware.num_nodes
    if hardware.memory_gb_per_device <= 0:
        return 1
    need = stored_weight_bytes(model)
    group = 1
    while group <= world:
        if need <= group * hardware.memory_gb_per_device * 1e9 * weight_memory_fraction:
            return group
        group *= 2
    return None


def ring_allreduce_seconds(message_bytes: float, group: int, link_gbs: float) -> float:
    """Bandwidth term of a ring all-reduce: each device sends and receives 2(P − 1)/P of the message."""
    if group <= 1:
        return 0.0
    if link_gbs <= 0:
        raise ConfigError("hardware.interconnect_bandwidth_gbs must be > 0 for a multi-device plan")
    return 2.0 * (group - 1) / group * message_bytes / (link_gbs * 1e9)


def allreduces_per_forward(model: ModelConfig) -> int:
    """Tensor parallelism reduces after attention and after the MLP of every layer."""
    return 2 * model.num_layers
