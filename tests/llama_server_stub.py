"""A stand-in for llama.cpp's llama-server in the fast tests: the endpoints and answers adaspec
uses, on 127.0.0.1 only. Run as ``python llama_server_stub.py -m FILE --port N ...`` (the
launcher's command line); ``--version`` prints a version line.

Behaviour is set by environment variables:

* ``STUB_ARGV``: write the command line (JSON list) to this file;
* ``STUB_REQUESTS``: append every POST body (JSON lines, with its path) to this file;
* ``STUB_MODE``: ``ok`` (default); ``exit`` (print an error and exit 3 at once); ``unhealthy``
  (``/health`` answers 503 for ever); ``fail`` (``/completion`` and chat answer HTTP 400 with a
  llama-server error body); ``flaky`` (every second chat request answers that HTTP 400);
  ``die`` (exit during the first ``/completion``);
* ``STUB_LOAD_S``: seconds ``/health`` answers 503 (loading) before 200;
* ``STUB_ANSWERS``: a JSON file {"comma-joined prompt ids": [new token ids]}; other prompts get
  ``last prompt id + 1, + 2, ...`` (mod 32);
* ``STUB_SLOT_CTX``: the per-slot context ``/props`` reports (default: -c / -np).

``/completion`` answers with llama-server's fields (``tokens``, ``timings``: ``prompt_n``,
``prompt_ms``, ``predicted_n``, ``predicted_ms``, ``draft_n``, ``draft_n_accepted``, ``cache_n``);
``/v1/chat/completions`` streams one chunk per word and a usage chunk.
"""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE = os.environ.get("STUB_MODE", "ok")
T_START = time.monotonic()


def _arg(argv: list[str], *names: str, default: str | None = None) -> str | None:
    value = default
    for i, a in enumerate(argv[:-1]):
        if a in names:
            value = argv[i + 1]  # the last occurrence wins, as in llama-server
    return value


class Handler(BaseHTTPRequestHandler):
    argv: list[str] = []
    chats = 0  # chat requests so far (``flaky``)

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _json(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str) -> None:
        self._json(code, {"error": {"code": code, "message": message, "type": "exceed_context_size_error"}})

    def do_GET(self) -> None:
        if self.path == "/health":
            loading = MODE == "unhealthy" or time.monotonic() - T_START < float(os.environ.get("STUB_LOAD_S", "0"))
            if loading:
                self._json(503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
            else:
                self._json(200, {"status": "ok"})
        elif self.path == "/props":
            n_ctx, n_par = int(_arg(self.argv, "-c", default="4096")), int(_arg(self.argv, "-np", default="1"))
            slot = int(os.environ.get("STUB_SLOT_CTX", n_ctx // n_par))
            self._json(200, {"default_generation_settings": {"n_ctx": slot}, "total_slots": n_par})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "stub-model", "object": "model"}]})
        else:
            self._error(404, f"no {self.path}")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if os.environ.get("STUB_REQUESTS"):
            with open(os.environ["STUB_REQUESTS"], "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"path": self.path, "body": body}) + "\n")
        if self.path == "/completion":
            self._completion(body)
        elif self.path == "/apply-template":
            self._json(200, {"prompt": " ".join(m["content"] for m in body["messages"])})
        elif self.path == "/tokenize":
            self._json(200, {"tokens": list(range(len(body["content"].split())))})
        elif self.path == "/v1/chat/completions":
            self._chat(body)
        else:
            self._error(404, f"no {self.path}")

    def _completion(self, body: dict) -> None:
        if MODE == "die":
            os._exit(5)
        if MODE == "fail":
            self._error(400, "the request exceeds the available context size, try increasing it")
            return
        prompt = [int(t) for t in body["prompt"]]
        answers = {}
        if os.environ.get("STUB_ANSWERS"):
            with open(os.environ["STUB_ANSWERS"], encoding="utf-8") as fh:
                answers = json.load(fh)
        n = int(body["n_predict"])
        tokens = answers.get(",".join(map(str, prompt)), [(prompt[-1] + 1 + i) % 32 for i in range(n)])[:n]
        spec = "--spec-type" in self.argv or "--spec-default" in self.argv
        timings = {"cache_n": 0, "prompt_n": len(prompt), "prompt_ms": 10.0 + len(prompt),
                   "predicted_n": len(tokens), "predicted_ms": 2.0 * max(0, len(tokens) - 1)}
        if spec:
            timings |= {"draft_n": 6, "draft_n_accepted": 3}
        self._json(200, {"content": " ".join(map(str, tokens)), "tokens": tokens, "stop_type": "limit",
                         "truncated": False, "timings": timings})

    def _chat(self, body: dict) -> None:
        Handler.chats += 1
        if MODE == "fail" or (MODE == "flaky" and Handler.chats % 2 == 0):
            self._error(400, "the request exceeds the available context size, try increasing it")
            return
        words = body["messages"][-1]["content"].split()[: int(body.get("max_tokens") or 16)]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def event(obj: object) -> None:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

        base = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "stub-model"}
        for w in words:
            event(base | {"choices": [{"index": 0, "delta": {"content": w + " "}, "finish_reason": None}]})
        event(base | {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        event(base | {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(words),
                                               "total_tokens": 3 + len(words)}})
        self.wfile.write(b"data: [DONE]\n\n")


def main(argv: list[str]) -> None:
    if "--version" in argv:
        print("version: 1 (stub)")
        return
    if os.environ.get("STUB_ARGV"):
        with open(os.environ["STUB_ARGV"], "w", encoding="utf-8") as fh:
            json.dump(argv, fh)
    if MODE == "exit":
        print("error: failed to load model 'model.gguf'", file=sys.stderr)
        sys.exit(3)
    host = _arg(argv, "--host", default="127.0.0.1")
    assert host == "127.0.0.1", host  # tests listen on loopback only
    Handler.argv = argv
    server = ThreadingHTTPServer((host, int(_arg(argv, "--port", default="8080"))), Handler)
    print(f"main: server is listening on http://{host}:{server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
