"""Which servers an evaluation through an engine talks to, and how each is started.

Roles: `greedy` (no speculation: the reference text and the speed baseline), `eaglet` (the trained head),
`ngram` (prompt lookup), `baseline` (eval.baseline_draft). With eval.server.url eaglet connects to running
servers (url, ngram_url, greedy_url); otherwise it starts one server per role of eval.server.launch, in turn,
on eval.server.host:port, with the command a user would serve with (eaglet.formats.serving), and stops it
before the next.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from omegaconf import OmegaConf

from eaglet.config.choices import EvalBackend, ServerRole
from eaglet.config.schema import EagletConfig, ModelConfig
from eaglet.errors import ConfigError
from eaglet.evaluate.server_client import ServerClient, normalize_url
from eaglet.evaluate.server_launch import LaunchedServer
from eaglet.formats import serving

ENGINES = {EvalBackend.vllm_server: "vllm", EvalBackend.sglang_server: "sglang"}
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
CONNECT_KEYS = {
    "greedy": "eval.server.greedy_url",
    "eaglet": "eval.server.url",
    "ngram": "eval.server.ngram_url",
}

# (role, where it is: a URL or the launch command, a context that yields its client while it is up)
PlannedServer = tuple[str, str, contextlib.AbstractContextManager[ServerClient]]


def engine_of(cfg: EagletConfig) -> str:
    return ENGINES[EvalBackend(cfg.eval.backend)]


def weights_folder(model: ModelConfig) -> str | None:
    """model.path of a target loaded from a folder; None when unset (or loaded otherwise)."""
    if model.source != "path" or (OmegaConf.is_config(model) and OmegaConf.is_missing(model, "path")):
        return None
    return None if model.path in (None, "???") else str(model.path)


def served_target(cfg: EagletConfig) -> serving.ServedTarget:
    """What a launched server loads: eval.server.model, else the target's weights folder."""
    model, server = cfg.model, cfg.eval.server
    path = server.model or weights_folder(model)
    if path is None:
        raise ConfigError(
            f"eval.backend={cfg.eval.backend} starts {ENGINE_NAMES[engine_of(cfg)]} servers for the target, but "
            f"model {model.name!r} (model.source={model.source}) names no weights folder; set "
            "model.path=/path/to/weights or eval.server.model=<a folder or hub id the engine loads>, or connect "
            "to running servers with eval.server.url=http://host:port"
        )
    return serving.ServedTarget(
        model=str(path),
        tokenizer=model.tokenizer_path,
        trust_remote_code=model.trust_remote_code,
        tensor_parallel_size=server.tensor_parallel_size or cfg.hardware.devices,
        seed=cfg.seed,
        dtype=str(model.dtype),
    )


def role_speculation(cfg: EagletConfig, role: str, draft_dir: Path, k: int) -> serving.Speculation | None:
    ev = cfg.eval
    if role == ServerRole.greedy:
        return None
    if role == ServerRole.ngram:
        return serving.Speculation("ngram", k, ngram_min=ev.ngram_min_n, ngram_max=ev.ngram_max_n)
    folder = draft_dir if role == ServerRole.eaglet else Path(ev.baseline_draft or "")
    return serving.Speculation("eagle3", k, str(folder.resolve()))


def server_command(
    cfg: EagletConfig,
    role: str,
    draft_dir: Path,
    k: int,
    target: serving.ServedTarget,
    *,
    host: str,
    port: int,
) -> list[str]:
    """The engine's command line for `role`, eval.server.executable in front when set."""
    spec = role_speculation(cfg, role, draft_dir, k)
    if engine_of(cfg) == "vllm":
        executable, args = serving.VLLM_EXECUTABLE, serving.vllm_args(target, spec, host=host, port=port)
    else:
        executable, args = serving.SGLANG_EXECUTABLE, serving.sglang_args(target, spec, host=host, port=port)
    return [*(cfg.eval.server.executable or executable), *args, *cfg.eval.server.extra_args]


def launch_roles(cfg: EagletConfig) -> list[str]:
    """eval.server.launch in order, with `baseline` after `eaglet` when eval.baseline_draft is set."""
    roles = [str(r) for r in cfg.eval.server.launch]
    if cfg.eval.baseline_draft and ServerRole.baseline not in roles:
        roles.insert(roles.index("eaglet") + 1 if "eaglet" in roles else len(roles), "baseline")
    return roles


def planned_servers(
    cfg: EagletConfig, draft_dir: Path, k: int, log_dir: Path, roles: list[str] | None = None
) -> Iterator[PlannedServer]:
    """Every server of this evaluation, the greedy one first; `roles` launches just those."""
    ev, engine = cfg.eval, engine_of(cfg)
    timeout = ev.server.request_timeout_s
    if ev.server.url and roles is None:
        urls = {"greedy": ev.server.greedy_url, "eaglet": ev.server.url, "ngram": ev.server.ngram_url}
        for role, url in urls.items():
            if url:
                client = ServerClient(normalize_url(url, CONNECT_KEYS[role]), engine, timeout=timeout)
                yield (
                    role,
                    client.base,
                    _connected(client, role, _start_hint(cfg, role, draft_dir, k, client.base)),
                )
        return
    target = served_target(cfg)
    base = normalize_url(f"http://{ev.server.host}:{ev.server.port}", "eval.server.host")
    for role in roles or launch_roles(cfg):
        command = server_command(cfg, role, draft_dir, k, target, host=ev.server.host, port=ev.server.port)
        client = ServerClient(base, engine, timeout=timeout)
        log = log_dir / f"{role}.log"
        server = LaunchedServer(
            command, client, role=role, log_path=log, startup_timeout_s=ev.server.startup_timeout_s
        )
        yield role, shlex.join(command), server


@contextlib.contextmanager
def _connected(client: ServerClient, role: str, hint: str) -> Iterator[ServerClient]:
    if not client.ready():
        raise ConfigError(
            f"no {ENGINE_NAMES[client.engine]} server answers at {client.base} ({CONNECT_KEYS[role]}, the {role} "
            f"server); start it, e.g.\n  {hint}\nor fix {CONNECT_KEYS[role]}"
        )
    yield client


def _start_hint(cfg: EagletConfig, role: str, draft_dir: Path, k: int, base: str) -> str:
    """The command that would start the server a connect URL names."""
    try:
        target = served_target(cfg)
    except ConfigError:
        target = serving.ServedTarget(model="TARGET")
    url = urlparse(base)
    command = server_command(
        cfg, role, draft_dir, k, target, host=url.hostname or "0.0.0.0", port=url.port or 8000
    )
    return shlex.join(command)
