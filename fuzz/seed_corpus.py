#!/usr/bin/env python3
"""Seeds fuzz/corpus/<target>/ from the repo's golden files and fixtures (wire/tests/golden,
tests/fixtures/proxy, packaging/agentbox.example.toml), each with the target's fixed-size head
(flags, split seed) in front. Run from anywhere; it only adds files named seed-*. The corpus
kept in git is this plus what fuzzing found (minimized) plus every crash input (crash-*)."""

import hashlib
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"
GOLDEN = ROOT / "wire" / "tests" / "golden"
FIXTURES = ROOT / "tests" / "fixtures" / "proxy"


def put(target, head, payload):
    if isinstance(payload, str):
        payload = payload.encode()
    data = head + payload
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / ("seed-" + hashlib.sha1(data).hexdigest()[:16])).write_bytes(data)


def compact(path):
    return json.dumps(json.loads(path.read_text()), separators=(",", ":"))


def chat_sse(chunks, crlf=False):
    eol = "\r\n" if crlf else "\n"
    out = "".join(f"data: {json.dumps(c, separators=(',', ':'))}{eol}{eol}" for c in chunks)
    return out + f"data: [DONE]{eol}{eol}"


def anthropic_sse(events):
    out = ""
    for e in events:
        data = e.get("data", e)
        name = e.get("event", data.get("type", ""))
        out += f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
    return out


def inputs(kind):
    return sorted((GOLDEN / kind).glob("*/input.*"))


SEED2 = b"\x07\x00\x00\x00"  # a split seed: pieces of 1-64 bytes
ONE = b"\x00\x00\x00\x00"  # seed 0: one piece

for p in inputs("meter"):
    text = p.read_bytes()
    put("sse_decode", b"\xff\xff" + ONE, text)
    put("sse_decode", b"\x40\x00" + SEED2, text)
    put("anthropic_stream", SEED2, text)
    put("usage_meter", (b"\x01" if p.suffix == ".sse" else b"\x00") + SEED2, text)

for kind in ("stream", "responses_stream"):
    for i, p in enumerate(inputs(kind)):
        chunks = json.loads(p.read_text())
        sse = chat_sse(chunks, crlf=i % 5 == 0)
        put("chat_stream_sse", bytes([i % 2]) + (SEED2 if i % 3 else ONE), sse)
        if i % 4 == 0:
            put("sse_decode", b"\x00\x10" + SEED2, sse)
for p in sorted((GOLDEN / "stream").glob("*/expected.json"))[::3]:
    events = json.loads(p.read_text())
    if isinstance(events, list):
        put("anthropic_stream", SEED2, anthropic_sse(events))
for who in ("claude_code", "codex"):
    chunks = json.loads((FIXTURES / "answers" / who / "chunks.json").read_text())
    put("chat_stream_sse", b"\x01" + SEED2, chat_sse(chunks))
    put("chat_response", b"\x01\x00\x01", compact(FIXTURES / "answers" / who / "chat.json"))
sse_expected = json.loads((FIXTURES / "answers" / "claude_code" / "sse.expected.json").read_text())
put("anthropic_stream", ONE, anthropic_sse(sse_expected))
put("usage_meter", b"\x01" + SEED2, anthropic_sse(sse_expected))

for p in sorted((GOLDEN / "response").glob("*/expected.json"))[::2]:
    put("usage_meter", b"\x00" + SEED2, compact(p))

for i, p in enumerate(inputs("request")):
    body = compact(p)
    put("anthropic_request", bytes([i * 37 % 256, i]), body)
    put("gateway_request", bytes([i % 2, i % 4]), body)
    put("bridge_request", bytes([i % 2, 1, i, 0x10]), body)
for i, p in enumerate(inputs("responses_request")):
    put("responses_request", bytes([i * 37 % 256, i]), compact(p))
for i, p in enumerate(inputs("response") + inputs("responses_response")):
    put("chat_response", bytes([200, 0, i % 2]), compact(p))
for p in inputs("error"):
    e = json.loads(p.read_text())
    body = e.get("body", "")
    body = body if isinstance(body, str) else json.dumps(body)
    status = int(e.get("status", 500))
    put("chat_response", status.to_bytes(2, "little") + b"\x00", body)

put("anthropic_request", b"\xff\xff", compact(FIXTURES / "claude_code" / "01_first" / "request.json"))
put("responses_request", b"\xff\xff", compact(FIXTURES / "codex" / "01_first" / "request.json"))
put("gateway_request", b"\x00\x03", compact(FIXTURES / "claude_code" / "02_tool_result" / "request.json"))

put("policy_config", b"", (ROOT / "packaging" / "agentbox.example.toml").read_text())
put(
    "policy_config",
    b"",
    '[bridge]\nlisten = "127.0.0.1:7000"\n\n[models.m1]\nprovider = "openai"\n'
    'upstream_model = "gpt-5"\nkey_env = "OPENAI_API_KEY"\nbase_url = "https://api.openai.com/v1"\n',
)

LAUNCHER = [
    {"tid": "t-1", "model": "claude-sonnet", "cmd": ["claude", "-p"], "env": {"LANG": "C.UTF-8"},
     "timeout_s": 600, "token": "tok-abc", "stdin": "fix the bug"},
    {"tid": "t-1", "command": "make test", "timeout_s": 60, "venv": "/srv/venvs/py"},
    {"tid": "t-1", "path": "/srv/repos/app", "ref": "main~1"},
    {"tid": "t-1", "path": "/srv/repos/app", "branch": "agent/t-1"},
    {"path": "/srv/repos/app", "branch": "agent/t-1"},
]
for i, body in enumerate(LAUNCHER):
    put("launcher_request", bytes([i]), json.dumps(body))

BLACKBOX = [
    {"blackbox_type": "opencode", "router": "127.0.0.1:8000", "bound_session_id": "s1",
     "bound_instance_id": "i1", "backend_options": {"model": "m"},
     "server_config": {"max_sessions": 2, "backend_timeout": 1.5}},
    {"turn_id": "t1", "messages": [{"role": "user", "content": "hi"}], "mode": "async"},
    {"reason": "weights", "timeout_seconds": 30},
    {"reason": "done"},
    {"command": "ls -la", "timeout": 10},
]
for i, body in enumerate(BLACKBOX):
    put("blackbox_request", bytes([i]), json.dumps(body))
# Selector 5 is the proxy's chat policy; the high nibble its settings (5, 17, 35, 53: 0-3).
for i, p in enumerate(sorted((GOLDEN / "request").glob("*/expected.json"))[:8]):
    put("blackbox_request", bytes([(5, 17, 35, 53)[i % 4]]), compact(p))
