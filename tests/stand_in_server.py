"""A stand-in for a vLLM or SGLang server: their HTTP endpoints and speculative-decoding metrics, with counts
the test controls. It parses the engines' own command lines, so eaglet can launch it in their place:

    python tests/stand_in_server.py --plan PLAN.json vllm MODEL --port 8000 [--speculative-config JSON] ...
    python tests/stand_in_server.py --plan PLAN.json sglang --model-path MODEL --port 8000 \
        [--speculative-algorithm EAGLE3|NGRAM --speculative-num-draft-tokens K+1] ...

PLAN (JSON): per method ("eagle3", "ngram") the counts one request adds, {"drafts": d, "accepted_per_pos":
[a_0, ..]} (non-increasing); "answer_tokens": tokens per answer (default 10); "differ_after": {method: n}, the
speculative answers from the n-th timed request on differ from the greedy text; "startup_delay_s": /health
answers 503 until then; "exit_at_start": a message printed before exiting with status 1.

vLLM: GET /metrics in Prometheus text format (the spec_decode counters only when speculating, split over two
engines and starting from non-zero counts, as a server that served others would), POST /v1/completions with
token-id prompts. SGLang: POST /generate with input_ids, the counts in meta_info. Both: /health, /v1/models.
A request with max_tokens <= 4 is a warm-up: it counts, but not for differ_after.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# Counts the vLLM counters hold before the first request (other traffic since the server started).
EARLIER = {"drafts": 1000, "draft_tokens": 3000, "accepted": 1200, "requests": 77}


class State:
    def __init__(self, plan: dict[str, Any], engine: str, model: str, method: str | None, k: int) -> None:
        self.plan, self.engine, self.model, self.method, self.k = plan, engine, model, method, k
        self.started = time.monotonic()
        self.lock = threading.Lock()
        self.timed = 0
        self.requests = [EARLIER["requests"], 0]
        # Per engine label "0" and "1": drafts, draft tokens, accepted, accepted per position.
        first = [EARLIER["accepted"] // (i + 2) for i in range(k)]
        self.counters = [
            {"drafts": EARLIER["drafts"], "draft_tokens": EARLIER["draft_tokens"], "accepted": EARLIER["accepted"],
             "per_pos": first},
            {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * k},
        ]  # fmt: skip

    def per_request(self) -> dict[str, Any]:
        counts = self.plan[self.method]
        per_pos = (list(counts["accepted_per_pos"]) + [0] * self.k)[: self.k]
        return {"drafts": counts["drafts"], "per_pos": per_pos}

    def answer(self, prompt: list[int], max_tokens: int) -> tuple[str, int, dict[str, Any]]:
        n = min(max_tokens, int(self.plan.get("answer_tokens", 10)))
        seed = sum(prompt) % 997
        words = [f"w{(seed + i) % 50}" for i in range(n)]
        with self.lock:
            warm_up = max_tokens <= 4
            index = self.timed
            self.timed += 0 if warm_up else 1
            differ_after = (self.plan.get("differ_after") or {}).get(self.method or "")
            if self.method and not warm_up and differ_after is not None and index >= differ_after:
                words[-1] = "DIFFERENT"
            meta: dict[str, Any] = {"completion_tokens": n, "prompt_tokens": len(prompt)}
            if self.method:
                step = self.per_request()
                engine = index % 2
                c = self.counters[engine]
                c["drafts"] += step["drafts"]
                c["draft_tokens"] += step["drafts"] * self.k
                c["accepted"] += sum(step["per_pos"])
                c["per_pos"] = [a + b for a, b in zip(c["per_pos"], step["per_pos"], strict=True)]
                meta.update(self.sglang_meta(step, n))
            self.requests[index % 2] += 1
        return " ".join(words), n, meta

    def sglang_meta(self, step: dict[str, Any], n: int) -> dict[str, Any]:
        per_pos, drafts = step["per_pos"], step["drafts"]
        histogram = (
            [drafts - per_pos[0]] + [per_pos[j - 1] - per_pos[j] for j in range(1, self.k)] + [per_pos[-1]]
        )
        accepted = sum(per_pos)
        return {
            "spec_verify_ct": drafts,
            "spec_num_correct_drafts": accepted,
            "spec_num_proposed_drafts": drafts * self.k,
            "spec_accepted_drafts": accepted,
            "spec_correct_drafts_histogram": histogram,
            "spec_accept_histogram": histogram,
            "spec_accept_length": n / drafts if drafts else 0.0,
            "spec_accept_rate": accepted / (drafts * self.k) if drafts else 0.0,
        }

    def metrics(self) -> str:
        labels = [f'engine="{i}",model_name="{self.model}"' for i in range(2)]
        lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
                 "# TYPE vllm:num_requests_running gauge"]  # fmt: skip
        lines += [f"vllm:num_requests_running{{{label}}} 0.0" for label in labels]
        lines += ["# TYPE vllm:request_success counter"]
        for i, label in enumerate(labels):
            lines.append(
                f'vllm:request_success_total{{{label},finished_reason="length"}} {float(self.requests[i])}'
            )
            lines.append(f'vllm:request_success_total{{{label},finished_reason="stop"}} 0.0')
        if self.engine == "sglang":
            lines.append(f'sglang:spec_accept_length{{model_name="{self.model}"}} 2.5')
        if self.engine != "vllm" or not self.method:
            return "\n".join(lines) + "\n"
        for key, name in (
            ("drafts", "num_drafts"),
            ("draft_tokens", "num_draft_tokens"),
            ("accepted", "num_accepted_tokens"),
        ):
            lines += [f"# HELP vllm:spec_decode_{name} ...", f"# TYPE vllm:spec_decode_{name} counter"]
            for i, label in enumerate(labels):
                lines.append(f"vllm:spec_decode_{name}_total{{{label}}} {float(self.counters[i][key])}")
                lines.append(f"vllm:spec_decode_{name}_created{{{label}}} 1.7e9")
        lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter")
        for i, label in enumerate(labels):
            for pos, value in enumerate(self.counters[i]["per_pos"]):
                lines.append(
                    f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{pos}"}} {float(value)}'
                )
        return "\n".join(lines) + "\n"


def handler(state: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:
            print(fmt % args, file=sys.stderr, flush=True)

        def reply(self, status: int, body: str, kind: str = "application/json") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if time.monotonic() - state.started < float(state.plan.get("startup_delay_s", 0)):
                self.reply(503, "{}")
            elif self.path == "/health":
                self.reply(200, "")
            elif self.path == "/v1/models":
                self.reply(
                    200, json.dumps({"object": "list", "data": [{"id": state.model, "object": "model"}]})
                )
            elif self.path == "/metrics":
                self.reply(200, state.metrics(), "text/plain; version=0.0.4")
            else:
                self.reply(404, json.dumps({"error": {"message": f"no route {self.path}"}}))

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if state.engine == "vllm" and self.path == "/v1/completions":
                text, n, _ = state.answer(list(body["prompt"]), int(body["max_tokens"]))
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
                answer = {"object": "text_completion", "model": state.model, "usage": usage,
                          "choices": [{"index": 0, "text": text, "finish_reason": "length"}]}  # fmt: skip
                self.reply(200, json.dumps(answer))
            elif state.engine == "sglang" and self.path == "/generate":
                sampling = body["sampling_params"]
                text, _, meta = state.answer(list(body["input_ids"]), int(sampling["max_new_tokens"]))
                self.reply(200, json.dumps({"text": text, "meta_info": meta}))
            else:
                self.reply(404, json.dumps({"error": {"message": f"no route {self.path}"}}))

    return Handler


def parse(argv: list[str]) -> tuple[dict[str, Any], str, str, str | None, int, str, int]:
    """(plan, engine, model, method, draft length, host, port) from an engine's own command line."""
    head = argparse.ArgumentParser()
    head.add_argument("--plan", required=True)
    head.add_argument("engine", choices=["vllm", "sglang"])
    known, rest = head.parse_known_args(argv)
    args = argparse.ArgumentParser()
    args.add_argument("--host", default="127.0.0.1")
    args.add_argument("--port", type=int, default=8000)
    if known.engine == "vllm":
        args.add_argument("model")
        args.add_argument("--speculative-config")
    else:
        args.add_argument("--model-path", dest="model", required=True)
        args.add_argument("--speculative-algorithm")
        args.add_argument("--speculative-num-draft-tokens", type=int)
    parsed, _ = args.parse_known_args(rest)
    with open(known.plan) as f:
        plan = json.load(f)
    if known.engine == "vllm":
        config = json.loads(parsed.speculative_config) if parsed.speculative_config else {}
        method, k = config.get("method"), int(config.get("num_speculative_tokens", 0))
    else:
        algorithm = parsed.speculative_algorithm
        method = {"EAGLE3": "eagle3", "NGRAM": "ngram"}.get(algorithm or "")
        k = (parsed.speculative_num_draft_tokens or 1) - 1
    return plan, known.engine, parsed.model, method, k, parsed.host, parsed.port


def main(argv: list[str]) -> None:
    plan, engine, model, method, k, host, port = parse(argv)
    print(
        f"stand-in {engine} server: model {model}, speculation {method} (K={k}) on {host}:{port}", flush=True
    )
    if plan.get("exit_at_start"):
        print(plan["exit_at_start"], file=sys.stderr, flush=True)
        sys.exit(1)
    server = ThreadingHTTPServer((host, port), handler(State(plan, engine, model, method, k)))
    print(f"listening on {host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
