"""Continuing a stream on another engine when its engine is lost mid-answer.

The ingress keeps a `Ledger` for each stream it relays that can be
continued: the prompt's token ids and the ids sent so far (asked of vLLM
with `return_token_ids`, read from each chunk without parsing it, and
hidden again when the client did not ask for them), and the reader's buffer
(the same ReaderBuffer model the scheduler uses). When the engine is lost
after the first token, `continuation()` is a completions request for the
rest: prompt = prompt ids + sent ids, max_tokens less what was sent, the
same sampling, and the reader's buffer in `vllm_xargs`, so the engine's
policy ranks it by how soon its reader runs dry. `splice()` rewrites that
request's chunks into the client's stream: the same id and created time,
the chat chunk shape for a chat stream, usage counting the whole answer.

The last ids sent may end inside a UTF-8 character: vLLM held their text
back (it goes out with the token that completes the character). vLLM's
detokenizer, primed with a prompt that ends so, starts its first chunk with
the whole prompt's text. So the engine replica that takes a continuation
cuts such ids off its prompt (`end_on_whole_character`); they are generated
again, their text goes out then, and the ingress learns how many from the
prompt ids the continuation reports. Only the replica can tell: its
tokenizer knows the ids' bytes, and a chunk's text does not show where it
stopped (a chunk can carry several ids, the last one held back).

What is not continued (such a stream ends with the lost-engine error event,
as before): a stream whose body says `"tokenflow_continuation": false`,
n > 1, logprobs, echo, stop strings (vLLM holds back text that may start
one, so the text sent can lag the ids sent), tools, structured output,
several prompts in one request. A seeded sampled stream continues with a
different random stream after the splice.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, AsyncIterator, Callable

from tokenflow.core.buffer import ReaderBuffer
from tokenflow.core.config import (
    CARRIED_KEY,
    CONTINUATION_KEY,
    MOVABLE_KEY,
    PIN_KEY,
    RATE_KEY,
    REBALANCE_KEY,
    SENT_KEY,
    WAITED_KEY,
    stated_rate,
)
from tokenflow.serve.sse import TOKEN_IDS as _TOKEN_IDS
from tokenflow.serve.sse import answer_over

# Where vLLM (compact JSON) writes the prompt's ids; the answer's: _TOKEN_IDS.
_PROMPT_IDS = '"prompt_token_ids":['
_ID = re.compile(r'"id":"([^"]*)"')
_CREATED = re.compile(r'"created":(\d+)')

# Sampling fields a chat request and a completions request share, carried
# over to the continuation as they are.
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "stop_token_ids", "ignore_eos", "skip_special_tokens",
            "spaces_between_special_tokens", "logit_bias", "allowed_token_ids", "bad_words", "priority",
            "include_stop_str_in_output", "user")


def continuable(body: Any, call_method: str) -> bool:
    """Whether a request is a stream this module can continue (module doc)."""
    if call_method not in ("chat", "completions") or not getattr(body, "stream", False):
        return False
    if (getattr(body, "model_extra", None) or {}).get(CONTINUATION_KEY) is False:
        return False  # the client opted out
    if (getattr(body, "n", 1) or 1) != 1 or getattr(body, "logprobs", None) or getattr(body, "stop", None):
        return False
    if getattr(body, "structured_outputs", None) is not None:
        return False
    if call_method == "completions":
        prompt = body.prompt
        single = isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))
        return single and not body.echo and not getattr(body, "suffix", None)
    fmt = getattr(body, "response_format", None)
    return (not getattr(body, "tools", None) and not getattr(body, "top_logprobs", None)
            and (fmt is None or getattr(fmt, "type", "text") == "text"))


class Ledger:
    """What the ingress keeps of one stream to continue it elsewhere. Every
    chunk of every such stream passes `_note`, so it only slices the ids'
    text out; they are parsed, and the reader's buffer worked out, only when
    a continuation needs them."""

    def __init__(self, body: Any, call_method: str, default_rate: float, max_continuations: int = 2,
                 clock=time.monotonic, on_splice: Callable[[float, float], None] | None = None):
        """on_splice(gap_s, stall_s) hears, at each continuation's first
        token, how long the reader got no token and how long of that it
        waited on an empty buffer."""
        self.body = body
        self.chat = call_method == "chat"
        self.clock = clock
        # The client asked for the ids itself: leave them in its chunks.
        self.show_ids = bool(getattr(body, "return_token_ids", False))
        body.return_token_ids = True
        # Whether its engine may move it (routing/rebalance.py): while a
        # continuation is left, unless the client asked it to stay.
        self.movable = (getattr(body, "model_extra", None) or {}).get(REBALANCE_KEY) is not False
        body.vllm_xargs = {**(body.vllm_xargs or {}), MOVABLE_KEY: int(self.movable and max_continuations > 0)}
        self.prompt_ids: list[int] | None = None
        self.stream_id: str | None = None
        self.created: int | None = None
        self.continued = 0  # continuations opened so far
        self.max_continuations = max_continuations
        self.rate = stated_rate(body, default_rate)
        self.arrival = clock()
        self._ids: list[int] = []  # sent, parsed
        self._raw: list[str] = []  # sent, as the chunks' text ("5,81,7"), not parsed yet
        self._base = 0  # ids of the answer before the open continuation's own (its prompt's tail)
        self._repeat = 0  # ids the continuation generates again (hidden from a client that sees ids)
        self._times: list[tuple[float, int]] = []  # (when, how many) of each chunk with tokens
        self.on_splice = on_splice
        self._gap_from: tuple[float, float] | None = None  # (last token before the loss, buffer then, s)
        # The answer's finish reason went out: a loss now is not continued
        # (it would generate past the answer's end); `closing()` ends it.
        self.finished = False

    @property
    def sent_ids(self) -> list[int]:
        if self._raw:
            self._ids.extend(int(x) for part in self._raw for x in part.split(","))
            self._raw.clear()
        return self._ids

    def reader(self) -> ReaderBuffer:
        """The reader's buffer model, fed with every token sent so far."""
        r = ReaderBuffer(rate=self.rate, arrival_time=self.arrival)
        for t, n in self._times:
            r.on_tokens(t, n)
        return r

    # --- the stream as first opened ------------------------------------
    async def watch(self, gen: AsyncIterator) -> AsyncIterator:
        """Yield the engine's items, noting the ids they carry."""
        async for item in gen:
            yield self._note(item)

    def _note(self, item: Any) -> Any:
        if isinstance(item, list):
            return [self._note(x) for x in item]
        if not isinstance(item, str):
            return item
        if not self.finished and answer_over(item):
            self.finished = True
        if self.prompt_ids is None and (i := item.find(_PROMPT_IDS)) >= 0:
            j = item.find("]", i)
            self.prompt_ids = json.loads(item[i + len(_PROMPT_IDS) - 1:j + 1])
            m, c = _ID.search(item), _CREATED.search(item)
            self.stream_id, self.created = (m.group(1) if m else None), (int(c.group(1)) if c else None)
            if not self.show_ids:
                item = item[:i] + '"prompt_token_ids":null' + item[j + 1:]
        start, n, parts = 0, 0, []
        while (i := item.find(_TOKEN_IDS, start)) >= 0:  # one per choice (n == 1: one)
            j = item.find("]", i)
            if ids := item[i + len(_TOKEN_IDS):j]:
                self._raw.append(ids)
                n += ids.count(",") + 1
            parts.append(item[start:i])
            start = j + 1
        if n:
            self._went_out(n)
        if not parts or self.show_ids:
            return item
        parts.append(item[start:])
        return '"token_ids":null'.join(parts)

    def _went_out(self, n: int) -> None:
        """n tokens went out now; the first after a loss closes its gap."""
        now = self.clock()
        self._times.append((now, n))
        if self._gap_from is not None:
            last, held = self._gap_from
            self._gap_from = None
            if self.on_splice is not None:
                self.on_splice(now - last, max(0.0, now - last - held))

    # --- the continuation ------------------------------------------------
    def continuation(self, to: str | None = None):
        """The completions request that finishes this answer, or None when
        it is not to be continued: `max_continuations` opened already, no
        prompt ids seen, or nothing left to generate. `to`: the engine it
        must go to (its engine moved it there), while that engine serves."""
        from ray.serve.llm.openai_api_models import CompletionRequest

        if (self.finished or self.continued >= self.max_continuations or self.prompt_ids is None
                or self.stream_id is None):
            return None
        body = self.body
        sent = self.sent_ids
        limit = (getattr(body, "max_completion_tokens", None) or body.max_tokens) if self.chat else body.max_tokens
        left = None if limit is None else limit - len(sent)
        if left is not None and left <= 0:
            return None
        now = self.clock()
        reader = self.reader()
        if self._gap_from is None and self._times:
            last = self._times[-1][0]
            self._gap_from = (last, reader.buffer(last) / self.rate)
        xargs = dict(body.vllm_xargs or {})
        xargs[RATE_KEY] = self.rate
        xargs[CARRIED_KEY] = round(reader.buffer(now), 3)
        xargs[WAITED_KEY] = round(now - self.arrival, 3)
        xargs[SENT_KEY] = len(sent)
        xargs[MOVABLE_KEY] = int(self.movable and self.continued + 1 < self.max_continuations)
        fields = {k: getattr(body, k) for k in SAMPLING
                  if k in body.model_fields_set and k in CompletionRequest.model_fields}
        if getattr(body, "min_tokens", 0):
            fields["min_tokens"] = max(0, body.min_tokens - len(sent))
        self.continued += 1
        self._base = len(sent)
        if to:
            fields[PIN_KEY] = to  # read by the request router (routing/request_router.py)
        return CompletionRequest(model=body.model, prompt=self.prompt_ids + sent, max_tokens=left,
                                 stream=True, stream_options=body.stream_options, return_token_ids=True,
                                 vllm_xargs=xargs, **fields)

    def closing(self) -> list[str] | None:
        """What ends the stream once its whole answer went out and only the
        closing chunks were lost: the usage chunk, if the client asked for
        one ([DONE] follows from Serve LLM's stream wrapper); None while
        the answer is not over."""
        if not self.finished or self.prompt_ids is None:
            return None
        opts = getattr(self.body, "stream_options", None)
        if not (opts and getattr(opts, "include_usage", False)):
            return []
        out = {"id": self.stream_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.body.model, "choices": []}
        return [self._event(out, len(self.sent_ids))]

    async def splice(self, gen: AsyncIterator) -> AsyncIterator:
        """Yield a continuation's items as parts of the client's stream."""
        async for item in gen:
            yield self._rewrite(item)

    def _rewrite(self, item: Any) -> Any:
        if isinstance(item, list):
            return [self._rewrite(x) for x in item]
        if not isinstance(item, str) or not item.startswith("data: {"):
            return item  # [DONE], or an object the ingress handles itself
        ev = json.loads(item[6:])
        if "error" in ev:
            return item
        n = 0
        choices = []
        for ch in ev.get("choices") or ():
            if ch.get("prompt_token_ids"):  # the first chunk: the prompt the replica ran
                self._cut(len(self.prompt_ids) + self._base - len(ch["prompt_token_ids"]))
            self.finished = self.finished or ch.get("finish_reason") is not None
            ids = ch.get("token_ids") or []
            self.sent_ids.extend(ids)
            n += len(ids)
            shown, self._repeat = ids[self._repeat:], max(0, self._repeat - len(ids))
            choices.append(self._as_chat(ch, shown) if self.chat else
                           {**ch, "prompt_token_ids": None, "token_ids": shown if self.show_ids else None})
        if n:
            self._went_out(n)
        out = {"id": self.stream_id, "object": "chat.completion.chunk" if self.chat else ev.get("object"),
               "created": self.created if self.created is not None else ev.get("created"),
               "model": ev.get("model"), "choices": choices}
        return self._event(out, self._base + ev["usage"]["completion_tokens"] if ev.get("usage") else None)

    def _event(self, out: dict, done: int | None) -> str:
        """`out` as the client's SSE event, compact as vLLM writes it; with
        usage counting the whole answer's `done` tokens, unless None."""
        if done is not None:
            prompt = len(self.prompt_ids)
            out["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt + done, "completion_tokens": done}
        return f"data: {json.dumps(out, separators=(',', ':'))}\n\n"

    def _cut(self, n: int) -> None:
        """The replica cut the last n sent ids off the continuation's prompt
        (`end_on_whole_character`): it generates them again, their text
        was not sent, and a client that sees ids has seen them."""
        n = max(0, min(n, self._base))
        if n:
            del self.sent_ids[len(self.sent_ids) - n:]
            self._base -= n
            self._repeat += n

    def _as_chat(self, ch: dict, ids: list[int]) -> dict:
        """A completions choice as the chat chunk's choice vLLM would send."""
        out = {"index": 0, "delta": {"content": ch["text"]} if ch.get("text") else {}, "logprobs": None,
               "finish_reason": ch.get("finish_reason"), "token_ids": ids if self.show_ids else None}
        if ch.get("finish_reason") is not None:
            out["stop_reason"] = ch.get("stop_reason")
        return out


# A character is at most 4 bytes and a token at least 1: the last 8 ids
# hold the whole last character, wherever the window starts.
_TAIL = 8


def unfinished_ids(prompt: list[int], sent: int, decode: Callable[[list[int]], str]) -> int:
    """How many of the prompt's last `sent` ids (the answer's, sent already)
    leave it ending inside a character: decoded, the text ends in U+FFFD,
    which is also when vLLM's detokenizer holds a token's text back."""
    n = 0
    while n < sent:
        end = len(prompt) - n
        if not decode(prompt[max(0, end - _TAIL):end]).endswith("\ufffd"):
            break
        n += 1
    return n


def end_on_whole_character(request: Any, decode: Callable[[list[int]], str]) -> int:
    """On the replica: cut a continuation's prompt back to its last whole
    character (module doc), to generate the cut ids again; how many."""
    try:
        sent = int((request.vllm_xargs or {}).get(SENT_KEY, 0))
    except (TypeError, ValueError):
        return 0
    prompt = request.prompt
    if sent <= 0 or not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
        return 0
    n = unfinished_ids(prompt, min(sent, len(prompt)), decode)
    if n:
        request.prompt = prompt[:-n]
        if request.max_tokens is not None:
            request.max_tokens += n
        if getattr(request, "min_tokens", 0):
            request.min_tokens += n
    return n
