// A reward sidecar in Node.js (docs/sidecar-protocol.md), with ways to misbehave for the tests.
//
//     node reward.js [MODE [N]]
//
// Same scores and modes as reward.py: the completion's length, +1000 when it equals the row's
// "answer", null for an empty completion; MODE ok | crash_after N | hang_after N | garbage |
// wrong_id | error | exit_on_start.
"use strict";
const readline = require("readline");

const MODE = process.argv[2] || "ok";
const N = Number(process.argv[3] || 0);

function send(message) {
  process.stdout.write(JSON.stringify(message) + "\n");
}

function score(params) {
  const answers = params.fields.answer || params.completions.map(() => null);
  return {
    rewards: params.completions.map((completion, i) => {
      if (completion.length === 0) return null;
      const bonus = answers[i] !== null && completion === String(answers[i]) ? 1000 : 0;
      return completion.length + bonus;
    }),
  };
}

if (MODE === "exit_on_start") {
  process.stderr.write("reward sidecar (js): missing API key\n");
  process.exit(5);
}

let calls = 0;
const lines = readline.createInterface({ input: process.stdin });
lines.on("line", (line) => {
  if (!line.trim()) return;
  const request = JSON.parse(line);
  const id = request.id;
  if (request.method === "describe") {
    send({ jsonrpc: "2.0", id, result: { name: "js-length", kinds: ["reward"] } });
    return;
  }
  if (request.method !== "reward.score") {
    send({ jsonrpc: "2.0", id, error: { code: -32601, message: `no method ${request.method}` } });
    return;
  }
  calls += 1;
  if (MODE === "crash_after" && calls > N) {
    process.stderr.write(`reward sidecar (js): crashing on call ${calls}\n`);
    process.exit(3);
  }
  if (MODE === "hang_after" && calls > N) {
    process.stderr.write(`reward sidecar (js): hanging on call ${calls}\n`);
    lines.pause();
    return; // never answers; the event loop stays alive on stdin
  }
  if (MODE === "garbage") process.stdout.write("TypeError: cannot read properties of undefined\n");
  else if (MODE === "wrong_id") send({ jsonrpc: "2.0", id: id + 1000, result: score(request.params) });
  else if (MODE === "error") send({ jsonrpc: "2.0", id, error: { code: -32000, message: "judge unavailable" } });
  else send({ jsonrpc: "2.0", id, result: score(request.params) });
});
lines.on("close", () => process.exit(0));
