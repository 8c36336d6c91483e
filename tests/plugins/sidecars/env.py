"""A multi-turn env sidecar in Python (docs/sidecar-protocol.md): one process, many episodes.

    python env.py [MODE [N]]

Each episode runs `options.turns` assistant turns (default 2); a turn's reward is 1.0 when the
reply contains the row's "answer", else len(reply) / 10. describe advertises a `peek` tool (for
the chat template). MODE: ok (default); crash_after N (exit 3 on env.step call N+1).
"""

import json
import sys

MODE = sys.argv[1] if len(sys.argv) > 1 else "ok"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 0
PEEK = {
    "type": "function",
    "function": {
        "name": "peek",
        "description": "Peek at the answer's first digit.",
        "parameters": {"type": "object", "properties": {}},
    },
}


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main():
    episodes = {}
    steps = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        method, rid, params = request["method"], request["id"], request.get("params", {})
        if method == "describe":
            send({"jsonrpc": "2.0", "id": rid, "result": {"name": "turns", "kinds": ["env"], "tools": [PEEK]}})
        elif method == "env.reset":
            row = params["row"]
            turns = int(params["options"].get("turns", 2))
            episodes[params["episode_id"]] = {"turn": 0, "turns": turns, "answer": row.get("answer")}
            prompt = row["prompt"]
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            send({"jsonrpc": "2.0", "id": rid, "result": {"messages": messages}})
        elif method == "env.step":
            steps += 1
            if MODE == "crash_after" and steps > N:
                print(f"env sidecar: crashing on step {steps}", file=sys.stderr, flush=True)
                sys.exit(3)
            episode = episodes.get(params["episode_id"])
            if episode is None:
                error = {"code": -32602, "message": f"unknown episode {params['episode_id']}"}
                send({"jsonrpc": "2.0", "id": rid, "error": error})
                continue
            episode["turn"] += 1
            reply = params["message"]["content"]
            answer = episode["answer"]
            reward = 1.0 if answer is not None and str(answer) in reply else len(reply) / 10
            done = episode["turn"] >= episode["turns"]
            messages = [] if done else [{"role": "user", "content": f"turn {episode['turn']} done, go on"}]
            if done:
                del episodes[params["episode_id"]]
            result = {"messages": messages, "reward": reward, "done": done, "info": {"turn": episode["turn"]}}
            send({"jsonrpc": "2.0", "id": rid, "result": result})
        else:
            send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": f"no method {method}"}})


main()
