"""Per-request accounting of one streamed answer (pure Python, no Locust).

The Locust user feeds this class the raw SSE lines of a chat-completion
stream with their arrival times; everything the load test reports (TTFT,
chunk arrival times, TBT, stall time, effective-throughput tokens, Andes
QoE) comes from tokenflow.core.buffer.ReaderBuffer, the same reader model the
scheduler and `tokenflow bench` use.

Token counts. The user asks for `stream_options: {include_usage: true,
continuous_usage_stats: true}`; vLLM then puts the cumulative
`completion_tokens` on every chunk, so each chunk's token count is exact
(a chunk can carry several tokens, or none when the detokenizer holds back
an incomplete character). A server that ignores `continuous_usage_stats`
still sends the final usage chunk: then each chunk with text counts as one
token, and any shortfall against the final usage is added at the time that
usage chunk arrives (`exact_counts` is false in the record).
"""

from __future__ import annotations

import json

from tokenflow.core.buffer import ReaderBuffer

DONE = "[DONE]"


class StreamError(Exception):
    """The server reported an error inside the stream, or the stream is malformed."""


def sse_data(line: bytes | str) -> str | None:
    """Payload of one SSE `data:` line; None for blank lines, comments, other fields."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    line = line.rstrip("\r\n")
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def _content(choice: dict) -> str:
    """Any generated text in a chunk: chat delta fields (content, reasoning)
    or a text completion's `text`; the role-only first chunk has none."""
    delta = choice.get("delta") or {}
    parts = [v for k, v in delta.items() if k != "role" and isinstance(v, str)]
    return "".join(parts) + (choice.get("text") or "")


class RequestRecorder:
    """One request seen from its reader: feed (time, tokens) events, then close()."""

    def __init__(self, rate: float, sent_at: float):
        self.reader = ReaderBuffer(rate=rate, arrival_time=sent_at)
        self.sent_at = sent_at
        self.chunks: list[tuple[float, int]] = []  # (arrival time, tokens in the chunk)
        self.counted = 0
        self.usage: dict | None = None
        self.exact_counts = False
        self.finish_reason: str | None = None
        self.saw_done = False
        self.end_at: float | None = None

    # --- events --------------------------------------------------------
    def on_tokens(self, t: float, n: int) -> None:
        if n <= 0:
            return
        self.reader.on_tokens(t, n)
        self.chunks.append((t, n))
        self.counted += n

    def on_chunk(self, t: float, chunk: dict) -> None:
        """One decoded `chat.completion.chunk` (or text completion chunk)."""
        if "error" in chunk:
            err = chunk["error"]
            raise StreamError(f"server error in stream: {err.get('message', err) if isinstance(err, dict) else err}")
        usage = chunk.get("usage") or None
        if usage is not None:
            self.usage = usage
        choices = chunk.get("choices") or []
        if choices:
            choice = choices[0]
            if usage is not None and usage.get("completion_tokens") is not None:
                self.exact_counts = True  # continuous usage: the count so far is exact
                self.on_tokens(t, int(usage["completion_tokens"]) - self.counted)
            elif _content(choice):
                self.on_tokens(t, 1)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        elif usage is not None:
            # The final usage-only chunk: reconcile the per-chunk estimate.
            self.on_tokens(t, int(usage.get("completion_tokens") or 0) - self.counted)

    def on_line(self, t: float, line: bytes | str) -> bool:
        """One SSE line; True once the `[DONE]` sentinel arrives."""
        data = sse_data(line)
        if not data:
            return False
        if data == DONE:
            self.saw_done = True
            return True
        try:
            chunk = json.loads(data)
        except ValueError:
            raise StreamError(f"undecodable SSE data: {data[:200]!r}") from None
        if not isinstance(chunk, dict):
            raise StreamError(f"unexpected SSE data: {data[:200]!r}")
        self.on_chunk(t, chunk)
        return False

    def close(self, t: float) -> None:
        """The stream ended at t. The reader's answer is complete at its last
        token: no stall is counted after it, however late [DONE] comes."""
        self.end_at = t
        self.reader.on_finish(self.chunks[-1][0] if self.chunks else t)

    # --- results -------------------------------------------------------
    @property
    def ttft(self) -> float | None:
        return self.reader.ttft

    @property
    def tokens(self) -> int:
        return self.reader.delivered

    def stall(self) -> float | None:
        if self.reader.first_token_time is None:
            return None
        return self.reader.stall_time(self.end_at if self.end_at is not None else self.chunks[-1][0])

    def result(self) -> dict:
        """JSON-ready metrics; times in seconds, chunk times relative to the send."""
        r, s = self.reader, self.sent_at
        usage = self.usage or {}
        times = [t for t, _ in self.chunks]
        return {
            "rate": r.rate,
            "ttft_s": r.ttft,
            "tokens": r.delivered,
            "completion_tokens": usage.get("completion_tokens"),
            "prompt_tokens": usage.get("prompt_tokens"),
            "exact_counts": self.exact_counts,
            "finish_reason": self.finish_reason,
            "total_s": None if self.end_at is None else self.end_at - s,
            "stall_s": self.stall(),
            "effective_tokens": r.effective_tokens(),
            "qoe": r.qoe(),
            "chunks": [[round(t - s, 6), n] for t, n in self.chunks],
            "tbt_s": [round(b - a, 6) for a, b in zip(times, times[1:])],
        }
