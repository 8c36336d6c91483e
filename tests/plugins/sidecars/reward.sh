#!/bin/sh
# A reward sidecar in POSIX shell + jq (docs/sidecar-protocol.md): each completion scores its
# word count. One request per line in, one response per line out.
while IFS= read -r line; do
  method=$(printf '%s\n' "$line" | jq -r '.method')
  case "$method" in
    describe)
      printf '%s\n' "$line" | jq -c '{jsonrpc: "2.0", id: .id, result: {name: "sh-words", kinds: ["reward"]}}' ;;
    reward.score)
      printf '%s\n' "$line" | jq -c '{jsonrpc: "2.0", id: .id,
        result: {rewards: [.params.completions[] | [splits(" +")] | map(select(. != "")) | length]}}' ;;
    *)
      printf '%s\n' "$line" | jq -c '{jsonrpc: "2.0", id: .id, error: {code: -32601, message: "no such method"}}' ;;
  esac
done
