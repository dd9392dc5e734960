"""Reading the chunks an engine replica streams: tokens and usage.

What the replica's generator yields (ray.serve.llm 2.60, LLMServer.chat and
.completions): streaming responses as lists (one per ~50 ms batch) of SSE
strings "data: {json}\\n\\n"; non-streaming ones as one response object
with `.usage`; errors as an ErrorResponse object. Tokens are counted from
`usage.completion_tokens` when every chunk carries it, else from the
chunks' token ids when the request asked for them (both exact, and read
without parsing the events), else as one per content delta of choice 0
(a lower bound: a delta may hold several tokens) corrected by the usage
a chunk carries. The replica's stream tracker (streams.py) and the ingress's failover
(failover.py) both read chunks through here.
"""

from __future__ import annotations

import json
import re
from typing import Any

# What an engine replica sends last on a stream it hands to another engine
# (routing/rebalance.py), followed by that engine's id: the ingress
# continues the stream there on reading it. An SSE comment, so that a
# client would ignore it; ending the replica's stream normally keeps a
# routine move out of Serve's error logs and error counts.
MOVED_EVENT = ": tokenflow moved to "


def moved_event(engine_id: str) -> str:
    return f"{MOVED_EVENT}{engine_id}\n\n"


def moved_to(item: Any) -> str | None:
    """The engine a replica handed its stream to, if `item` says so (alone,
    or last in a batch); else None."""
    if isinstance(item, list):
        item = item[-1] if item else None
    if isinstance(item, str) and item.startswith(MOVED_EVENT):
        return item[len(MOVED_EVENT):].strip()
    return None

# usage.completion_tokens as vLLM writes it (compact JSON), found without
# parsing the chunk: with per-chunk usage (stream_options.continuous_usage_stats)
# it is the exact count, and the events need no parsing at all.
_COMPLETION_TOKENS = re.compile(r'"completion_tokens":\s*(\d+)')


# A choice's finish reason once it has one (a chunk still going on writes
# `"finish_reason":null`), and a chunk without choices (the closing usage
# chunk), as vLLM writes them (compact JSON).
_FINISHED = '"finish_reason":"'
_NO_CHOICES = '"choices":[]'


def answer_over(item: Any) -> bool:
    """Whether a chunk (or a batch) ends the answer or comes after its end:
    it carries the finish reason, or it is the closing usage chunk or
    [DONE]. Read from the text without parsing it."""
    if isinstance(item, (list, tuple)):
        return any(answer_over(x) for x in item)
    return isinstance(item, str) and (_FINISHED in item or _NO_CHOICES in item or item.startswith("data: [DONE]"))


def sse_events(text: str):
    """The JSON objects of an SSE text's `data:` lines ([DONE] and non-JSON skipped)."""
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == "[DONE]":
            continue
        try:
            ev = json.loads(payload)
        except ValueError:
            continue
        if isinstance(ev, dict):
            yield ev


def _delta_tokens(ev: dict) -> int:
    for ch in ev.get("choices") or ():
        if not isinstance(ch, dict) or ch.get("index", 0) != 0:
            continue
        delta = ch.get("delta")
        if isinstance(delta, dict):  # chat
            piece = (delta.get("content") or delta.get("reasoning_content")
                     or delta.get("reasoning") or delta.get("tool_calls"))
        else:  # text completion
            piece = ch.get("text")
        return 1 if piece else 0
    return 0


def _usage_of(obj: Any) -> int | None:
    usage = obj.get("usage") if isinstance(obj, dict) else getattr(obj, "usage", None)
    if usage is None:
        return None
    ct = usage.get("completion_tokens") if isinstance(usage, dict) else getattr(usage, "completion_tokens", None)
    return ct if isinstance(ct, int) else None


def count_chunk(item: Any) -> tuple[int, int | None]:
    """(content deltas of choice 0, latest usage.completion_tokens or None)."""
    if isinstance(item, (list, tuple)):
        total, usage = 0, None
        for x in item:
            n, u = count_chunk(x)
            total += n
            usage = u if u is not None else usage
        return total, usage
    if isinstance(item, bytes):
        item = item.decode("utf-8", errors="replace")
    if isinstance(item, str):
        total, usage = 0, None
        for ev in sse_events(item):
            total += _delta_tokens(ev)
            u = _usage_of(ev)
            usage = u if u is not None else usage
        return total, usage
    return 0, _usage_of(item)  # a whole (non-streaming) response, or an error


# Where vLLM (compact JSON) writes a choice's generated token ids, when the
# request asks for them (`return_token_ids`: TokenFlow's ingress asks for
# every stream it can continue, continuation.py). A quote inside generated
# text is escaped, so text cannot match; `"prompt_token_ids":[` does not
# hold it either.
TOKEN_IDS = '"token_ids":['


def ids_in(item: Any) -> int | None:
    """How many generated token ids a chunk (or a batch) carries, read from
    the text without parsing it: the exact count of its tokens. None when
    it carries none because the request did not ask for them."""
    if isinstance(item, (list, tuple)):
        total = None
        for x in item:
            if (n := ids_in(x)) is not None:
                total = n if total is None else total + n
        return total
    if isinstance(item, bytes):
        item = item.decode("utf-8", errors="replace")
    if not isinstance(item, str) or TOKEN_IDS not in item:
        return None
    n, start = 0, 0
    while (i := item.find(TOKEN_IDS, start)) >= 0:  # one per choice
        i += len(TOKEN_IDS)
        j = item.find("]", i)
        if j > i:
            n += item.count(",", i, j) + 1
        start = j + 1
    return n


def latest_usage(item: Any) -> int | None:
    """The last usage.completion_tokens an SSE chunk (or a batch of them)
    carries, read from the text without parsing it; None when it has none."""
    if isinstance(item, (list, tuple)):
        for x in reversed(item):
            if (u := latest_usage(x)) is not None:
                return u
        return None
    if isinstance(item, bytes):
        item = item.decode("utf-8", errors="replace")
    if not isinstance(item, str) or '"completion_tokens"' not in item:
        return None
    found = _COMPLETION_TOKENS.findall(item)
    return int(found[-1]) if found else None
