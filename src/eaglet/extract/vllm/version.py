"""Which vLLM a target needs, checked before any engine starts.

vLLM's hidden-state extraction (the `extract_hidden_states` speculative method with
`ExampleHiddenStatesConnector`) appeared in 0.18.0 (vllm-project/vllm#33736). eaglet asks it for the aux
layers and for id L, the last decoder layer's output before the final norm; whether id L comes back
depends on the model class:
- llama / mistral / qwen2 / qwen3 / gpt_oss backbones capture id L since the aux-capture refactor that
  shipped with the extraction feature (vllm#36063, 0.18.0).
- the DeepSeek-V2 backbone (DeepSeek-V3, Kimi-K2, Kimi-K2.5, which wraps it) dropped id L silently, and
  the engine then failed on a buffer of the wrong size, until vllm#46973 (merged 2026-06-29, after the
  0.24.0 release branch); 0.25.0 is the first release with it.
The installed version is read from package metadata, so nothing of vLLM is imported here.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from eaglet.errors import ConfigError

INSTALL_HINT = (
    "install it with `pip install -e .[vllm]` on a machine with CUDA GPUs (vLLM brings its own CUDA build "
    "of torch), or start a vLLM server elsewhere and set extract.vllm.url=http://host:8000"
)


@dataclass(frozen=True)
class Feature:
    name: str
    min_version: str
    source: str  # the upstream change that brought it


EXTRACTION = Feature(
    "hidden-state extraction (extract_hidden_states + ExampleHiddenStatesConnector)", "0.18.0", "vllm#33736"
)
_FINAL_LAYER_MIXIN = Feature("final-layer capture (aux id = num_layers)", "0.18.0", "vllm#36063")
_FINAL_LAYER_DEEPSEEK = Feature(
    "final-layer capture (aux id = num_layers) on the DeepSeek-V2 backbone", "0.25.0", "vllm#46973"
)

# eaglet model.architecture (transformers model_type) -> what vLLM needs for it.
_TARGET_FEATURES: dict[str, tuple[Feature, ...]] = {
    **{arch: (EXTRACTION, _FINAL_LAYER_MIXIN) for arch in ("llama", "mistral", "qwen2", "qwen3", "gpt_oss")},
    **{
        arch: (EXTRACTION, _FINAL_LAYER_DEEPSEEK)
        for arch in ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25")
    },
}


def supported_architectures() -> list[str]:
    return sorted(_TARGET_FEATURES)


def features_for(architecture: str) -> tuple[Feature, ...]:
    """The vLLM features extraction needs for this model class; ConfigError for a class eaglet has not checked."""
    if architecture not in _TARGET_FEATURES:
        raise ConfigError(
            f"model.architecture={architecture!r}: eaglet does not know which vLLM captures its aux and final "
            f"hidden states; the vLLM backend supports {supported_architectures()}. Use "
            "extract.backend=transformers for this target"
        )
    return _TARGET_FEATURES[architecture]


def required_version(architecture: str) -> Version:
    return max(Version(f.min_version) for f in features_for(architecture))


def installed_vllm_version() -> str | None:
    """The installed vLLM's version from package metadata (vLLM itself is not imported); None when absent."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_installed(architecture: str) -> Version:
    """Fail at once, in one line, when the local vLLM is missing or too old for this target."""
    found = installed_vllm_version()
    if found is None:
        need = required_version(architecture)
        raise ConfigError(
            f"extract.backend=vllm needs vLLM >= {need}, which is not installed; {INSTALL_HINT}"
        )
    return check_version(found, architecture, where="installed")


def check_version(found: str, architecture: str, *, where: str) -> Version:
    """`found` (a version string) must provide every feature `architecture` needs; returns it parsed."""
    features = features_for(architecture)
    try:
        version = Version(found)
    except InvalidVersion:
        raise ConfigError(
            f"cannot read the {where} vLLM version {found!r}; expected a version such as 0.25.1"
        ) from None
    # PEP 440 order: 0.25.0.dev3 < 0.25.0 <= 0.25.0+cu129 < 0.25.1.dev3 (a nightly after 0.25.0).
    missing = [f for f in features if version < Version(f.min_version)]
    if missing:
        need = max(Version(f.min_version) for f in missing)
        names = "; ".join(f"{f.name} from {f.min_version} ({f.source})" for f in missing)
        raise ConfigError(
            f"the {where} vLLM {found} is too old for model.architecture={architecture!r}: it needs vLLM >= "
            f"{need} ({names}); upgrade vLLM (`pip install -U 'vllm>={need}'`)"
        )
    return version
