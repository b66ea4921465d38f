"""Where a sweep trial's τ curve comes from, decided before the trial trains.

sweep.tau_source=decode decodes against the target: in this process when it loads here, through a server
eaglet launches per trial when eval.backend names an engine (eval.backend=vllm_server|sglang_server), and
otherwise on the validation shards (`sim`), which need no target. A target that cannot load here would
otherwise fail every trial after its training (a Kimi-K2.5 sweep on the default settings did).
"""

from __future__ import annotations

from dataclasses import dataclass

from eaglet.config.choices import EvalBackend, ExtractBackend, TauSource
from eaglet.config.schema import EagletConfig
from eaglet.errors import ConfigError
from eaglet.evaluate.server_plan import ENGINE_NAMES, engine_of, served_target, weights_folder
from eaglet.train.online import target_weight_bytes

DECODE, SERVER, SIM = "decode", "server", "sim"
# Bytes a parameter of the target takes in this process: float32 on CPU, bf16 on GPUs (model.dtype auto).
_ITEMSIZE = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


@dataclass(frozen=True)
class TauChoice:
    source: str  # DECODE (in this process), SERVER (through an engine) or SIM (validation shards)
    reason: str

    def line(self) -> str:
        return f"sweep: τ from {self.source}: {self.reason}"


def in_process_blocker(cfg: EagletConfig) -> str | None:
    """Why the target cannot load in this process for decoding, or None when it can (as far as the config
    tells: the planner's memory estimate, not a trial load)."""
    model, hw = cfg.model, cfg.hardware
    if cfg.extract.backend == ExtractBackend.vllm:
        return "extract.backend=vllm: this target is run by vLLM, not loaded in this process"
    # Unknown memory (hardware=cpu) is taken to hold the target, as the planner does.
    if hw.memory_gb_per_device > 0:
        itemsize = _ITEMSIZE.get(str(model.dtype), 2 if hw.accelerator == "gpu" else 4)
        need = target_weight_bytes(model, itemsize)
        if need > cfg.plan.weight_memory_fraction * hw.memory_gb_per_device * 1e9:
            return (
                f"the target's weights take about {need / 1e9:,.0f} GB at {itemsize} bytes a parameter, more "
                f"than {cfg.plan.weight_memory_fraction:.0%} of one {hw.gpu} ({hw.memory_gb_per_device:g} GB; "
                "plan.weight_memory_fraction)"
            )
    if model.source == "path" and weights_folder(model) is None:
        return f"model {model.name!r} has no model.path to load it from"
    return None


def choose_tau_source(cfg: EagletConfig) -> TauChoice:
    """The τ source of this trial, and why; a server setting that cannot work stops here, before training."""
    ev = cfg.eval
    if cfg.sweep.tau_source == TauSource.sim:
        return TauChoice(SIM, "sweep.tau_source=sim")
    if ev.backend != EvalBackend.in_process:
        if ev.server.url:
            raise ConfigError(
                "a sweep trains a new head in every trial, which a server started beforehand (eval.server.url) "
                "does not serve; leave eval.server.url unset and eaglet starts a server with each trial's head"
            )
        served_target(cfg)  # the server needs a target to load: say so before training
        engine = ENGINE_NAMES[engine_of(cfg)]
        return TauChoice(
            SERVER, f"eval.backend={ev.backend}: each trial's head is measured on a {engine} server"
        )
    blocker = in_process_blocker(cfg)
    if blocker is None:
        return TauChoice(DECODE, "the target loads in this process")
    return TauChoice(
        SIM,
        f"{blocker}; measuring on the validation shards instead (as sweep.tau_source=sim). To decode through a "
        "serving engine, set eval.backend=vllm_server (or sglang_server) and model.path",
    )
