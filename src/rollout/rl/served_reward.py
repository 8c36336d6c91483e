"""A served reward model as an RL reward: `[[algorithm.<grpo|ppo>.rewards]] kind = "reward_model"` with `url`.

    rollout serve --model local/models/rm-tiny --port 8001          # POST /v1/rewards (rollout.serve.reward_app)

    [[algorithm.ppo.rewards]]
    kind = "reward_model"
    url = "http://127.0.0.1:8001/v1"
    api_key_env = "RM_KEY"            # optional: the bearer key is read from this environment variable
    normalize = "group"

    rm = ServedRewardModel("http://127.0.0.1:8001/v1", normalize="group")
    rm.check()                          # GET /v1/models: reachable, and a reward model
    scores = rm(prompts, completions)   # POST /v1/rewards in chunks of batch_size items

The server returns raw scores; normalisation, the raw-score metric and the
running moments in snapshots are `NormalizedReward`'s, as for an in-process RM.
Connection failures, timeouts and 429/502/503/504 answers are retried
`max_retries` times with exponential backoff (a 503's Retry-After is honoured,
capped at 30 s); any other 4xx, or an answer that is not one finite score per
item, raises `RewardServerError` at once: the reward call fails and its samples
are dropped and counted (`rollout.rl.rewards.score_batch`), never scored 0.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from rollout.errors import RolloutError
from rollout.inference.types import Prompt
from rollout.rl.reward_model import Normalize, NormalizedReward

RETRY_STATUS = (429, 502, 503, 504)
MAX_WAIT_S = 30.0


class RewardServerError(RolloutError):
    """The reward server refused a request or answered something that is not scores."""


class ServedRewardModel(NormalizedReward):
    """Scores from `rollout serve`'s `POST /v1/rewards` at `url` (the server's `/v1` base)."""

    def __init__(
        self, url: str, *, model_name: str | None = None, api_key: str | None = None, batch_size: int = 32,
        timeout_s: float = 60.0, max_retries: int = 3, backoff_s: float = 0.5, normalize: Normalize = "none",
    ) -> None:
        super().__init__(normalize=normalize)
        self.url = url.rstrip("/")
        self.model_name, self.api_key = model_name, api_key
        self.batch_size, self.timeout_s = batch_size, timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s

    def check(self) -> str:
        """The served model's name; raises `RewardServerError` when the server cannot be used."""
        answer = self._request("GET", "/models", None)
        cards = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(cards, list) or not cards or not isinstance(cards[0], dict):
            raise RewardServerError(f"{self.url}/models: not a model list")
        card = cards[0]
        if card.get("kind") != "reward_model":
            raise RewardServerError(
                f"{self.url} serves {card.get('id')!r}, which is not a reward model (start `rollout serve --model"
                " <RM export>`; a generation server has no /v1/rewards)"
            )
        name = str(card.get("id"))
        if self.model_name is not None and name != self.model_name:
            raise RewardServerError(f"{self.url} serves {name!r}, not {self.model_name!r}")
        return name

    def _forward(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
        scores: list[float] = []
        for start in range(0, len(prompts), self.batch_size):
            items = [{"prompt": p if isinstance(p, str) else [dict(m) for m in p], "completion": c}
                     for p, c in zip(prompts[start : start + self.batch_size],
                                     completions[start : start + self.batch_size], strict=True)]
            body: dict[str, Any] = {"items": items}
            if self.model_name is not None:
                body["model"] = self.model_name
            scores += _scores(self._request("POST", "/rewards", body), len(items), self.url)
        return scores

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        """One JSON request, retried on connection errors, timeouts and 429/502/503/504."""
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        where = f"{self.url}{path}"
        for attempt in range(self.max_retries + 1):
            wait = self.backoff_s * 2**attempt
            try:
                request = urllib.request.Request(where, data=data, headers=headers, method=method)
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    raw = response.read()
                try:
                    return json.loads(raw)
                except ValueError:
                    raise RewardServerError(f"{where}: the answer is not JSON ({raw[:80]!r})") from None
            except urllib.error.HTTPError as err:
                message = _error_message(err)
                if err.code not in RETRY_STATUS or attempt == self.max_retries:
                    raise RewardServerError(f"{where}: HTTP {err.code}: {message}") from None
                after = err.headers.get("Retry-After") if err.headers else None
                if after is not None and after.isdigit():
                    wait = float(after)
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
                if attempt == self.max_retries:
                    reason = getattr(err, "reason", err)
                    raise RewardServerError(
                        f"cannot reach {where} after {attempt + 1} attempts: {reason}") from None
            time.sleep(min(wait, MAX_WAIT_S))
        raise AssertionError("unreachable")  # pragma: no cover


def _scores(answer: Any, count: int, url: str) -> list[float]:
    """One finite score per item, in item order (by each entry's index)."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list) or len(data) != count:
        got = len(data) if isinstance(data, list) else "no"
        raise RewardServerError(f"{url}/rewards answered {got} scores for {count} items")
    scores: list[float | None] = [None] * count
    for entry in data:
        index = entry.get("index") if isinstance(entry, dict) else None
        score = entry.get("score") if isinstance(entry, dict) else None
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count or scores[index] is not None:
            raise RewardServerError(f"{url}/rewards: bad or repeated index {index!r}")
        if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
            raise RewardServerError(f"{url}/rewards: item {index} has no finite score ({score!r})")
        scores[index] = float(score)
    return [s for s in scores if s is not None]


def _error_message(err: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(err.read() or b"{}")
    except (ValueError, OSError):
        return err.reason if isinstance(err.reason, str) else "error"
    message = body.get("error", {}).get("message") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
    return message or str(err.reason)
