"""The deployment a sweep predicts for (target x hardware) and its speedup per draft length."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from eaglet.config.schema import DraftConfig, HardwareConfig, ModelConfig
from eaglet.errors import ConfigError
from eaglet.formats.serving import speculative_config, vllm_command

# The vLLM line of a sweep's recommendation is built where every serving command is (eaglet.formats.serving).
__all__ = ["Deployment", "predicted_speedups", "resolve_deployment", "speculative_config", "vllm_command"]

# Serving hardware when a sweep trains on a machine without datasheet numbers (hardware=cpu).
FALLBACK_HARDWARE = "h200_x1"


@dataclass(frozen=True)
class Deployment:
    """Where the head would be served: the target's config, the draft head's shape and the hardware's."""

    model: Any  # ModelConfig or its DictConfig
    draft: Any  # DraftConfig or its DictConfig
    hardware: Any  # HardwareConfig or its DictConfig

    @property
    def tensor_parallel_size(self) -> int:
        """Devices of one node: the target's tensor-parallel group, which the draft shares."""
        return max(int(self.hardware.devices), 1)

    def to_dict(self) -> dict[str, Any]:
        return {"model": _plain(self.model), "draft": _plain(self.draft), "hardware": _plain(self.hardware)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Deployment:
        model = dict(data["model"])
        # Trials recorded before the draft group kept the draft shape inside the model.
        draft = data["draft"] if "draft" in data else model.pop("draft")
        model.pop("draft_vocab_size", None)
        return cls(
            _typed(ModelConfig, model), _typed(DraftConfig, draft), _typed(HardwareConfig, data["hardware"])
        )


def _plain(node: Any) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(node), resolve=True, enum_to_str=True)  # type: ignore[return-value]


def _typed(schema: type, data: dict[str, Any]) -> DictConfig:
    return OmegaConf.merge(OmegaConf.structured(schema), data)  # type: ignore[return-value]


def has_datasheet(hardware: Any) -> bool:
    return hardware.memory_bandwidth_gbs > 0 and hardware.bf16_tflops > 0


def resolve_deployment(
    model: Any, draft: Any, hardware: Any, serve_model: str | None = None, serve_hardware: str | None = None
) -> Deployment:
    """The named model with its draft / the named hardware (conf/model, conf/draft, conf/hardware), else this
    run's; h200_x1 for hardware without numbers."""
    from eaglet.plan.configs import load_draft, load_hardware, load_model

    if serve_model is not None:
        model, draft = load_model(serve_model), load_draft(serve_model)
    if serve_hardware is not None:
        hardware = load_hardware(serve_hardware)
    elif not has_datasheet(hardware):
        hardware = load_hardware(FALLBACK_HARDWARE)
    if not has_datasheet(hardware):
        raise ConfigError(
            f"hardware '{hardware.name}' has no memory_bandwidth_gbs / bf16_tflops to predict serving on; "
            "choose serving hardware that has them (sweep.serve_hardware=..., files in conf/hardware/)"
        )
    return Deployment(model, draft, hardware)


def predicted_speedups(deployment: Deployment, draft_vocab_size: int, taus: list[float]) -> list[float]:
    """Predicted decode speedup at draft lengths 1..len(taus), τ(K) measured at each."""
    from eaglet.plan.serving import predicted_speedup

    model, hardware = deployment.model, deployment.hardware
    return [
        float(predicted_speedup(model, hardware, deployment.draft, draft_vocab_size, tau, k))
        for k, tau in enumerate(taus, start=1)
    ]
