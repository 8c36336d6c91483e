"""A reward sidecar in Python (docs/sidecar-protocol.md), with ways to misbehave for the tests.

    python reward.py [MODE [N]]

Score: the completion's length, +1000 when it equals the row's "answer"; null (abstain) for an
empty completion. MODE: ok (default); crash_after N (exit 3 on reward.score call N+1 of this
process); hang_after N (never answer call N+1); garbage, wrong_id, error, bad_shape (on every
reward.score); exit_on_start (exit before reading anything); spawn_child (describe starts a
`sleep` child and reports its pid); bad_describe; env_only (describe lists kind "env" only);
slow_start (waits 0.5 s before reading anything, as a sidecar loading a model would).
"""

import json
import subprocess
import sys
import time

MODE = sys.argv[1] if len(sys.argv) > 1 else "ok"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 0


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def score(params):
    answers = params["fields"].get("answer") or [None] * len(params["completions"])
    rewards = []
    for completion, answer in zip(params["completions"], answers, strict=True):
        if not completion:
            rewards.append(None)
        else:
            rewards.append(len(completion) + (1000.0 if answer is not None and completion == str(answer) else 0.0))
    return {"rewards": rewards}


def main():
    if MODE == "slow_start":
        time.sleep(0.5)
    if MODE == "exit_on_start":
        print("reward sidecar: missing API key", file=sys.stderr, flush=True)
        sys.exit(5)
    calls = 0
    child = None
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        method, rid = request["method"], request["id"]
        if method == "describe":
            info = {"name": "py-length", "kinds": ["reward"]}
            if MODE == "spawn_child":
                child = subprocess.Popen(["sleep", "300"])
                info["child_pid"] = child.pid
            if MODE == "bad_describe":
                info["kinds"] = ["banana"]
            if MODE == "env_only":
                info["kinds"] = ["env"]
            send({"jsonrpc": "2.0", "id": rid, "result": info})
            continue
        if method != "reward.score":
            send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": f"no method {method}"}})
            continue
        calls += 1
        if MODE == "crash_after" and calls > N:
            print(f"reward sidecar: crashing on call {calls}", file=sys.stderr, flush=True)
            sys.exit(3)
        if MODE == "hang_after" and calls > N:
            print(f"reward sidecar: hanging on call {calls}", file=sys.stderr, flush=True)
            time.sleep(3600)
        if MODE == "garbage":
            sys.stdout.write("Traceback (most recent call last): oops\n")
            sys.stdout.flush()
        elif MODE == "wrong_id":
            send({"jsonrpc": "2.0", "id": rid + 1000, "result": score(request["params"])})
        elif MODE == "error":
            send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32000, "message": "judge unavailable"}})
        elif MODE == "bad_shape":
            send({"jsonrpc": "2.0", "id": rid, "result": [1, 2, 3]})
        else:
            send({"jsonrpc": "2.0", "id": rid, "result": score(request["params"])})


main()
