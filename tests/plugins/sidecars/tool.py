"""A tool sidecar in Python (docs/sidecar-protocol.md): `reverse(text)`, `add(a, b)` and
`nap(seconds)` (sleeps: a hang when longer than the sidecar's timeout)."""

import json
import sys
import time

TOOLS = [
    {"type": "function", "function": {
        "name": "reverse", "description": "Reverse a text.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}},
    {"name": "add", "description": "Add two integers.",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"]}},
    {"name": "nap", "description": "Sleep, then say so.",
     "parameters": {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}},
]


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


for line in sys.stdin:
    if not line.strip():
        continue
    request = json.loads(line)
    rid, params = request["id"], request.get("params", {})
    if request["method"] == "describe":
        send({"jsonrpc": "2.0", "id": rid, "result": {"name": "py-tools", "kinds": ["tool"], "tools": TOOLS}})
        continue
    name, args = params.get("name"), params.get("arguments", {})
    if name == "reverse":
        content = args["text"][::-1]
    elif name == "add":
        content = str(args["a"] + args["b"])
    elif name == "nap":
        time.sleep(args["seconds"])
        content = "rested"
    else:
        send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32602, "message": f"no tool {name!r}"}})
        continue
    send({"jsonrpc": "2.0", "id": rid, "result": {"content": content}})
