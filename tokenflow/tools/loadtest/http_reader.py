"""Streaming readers over HTTP with asyncio: the client of `tokenflow bench-app`.

Each request is one streamed chat completion, accounted for exactly as the
Locust users do it (tokenflow/tools/loadtest/recorder.py: chunk times, exact token counts
from continuous usage, the reader's buffer and stalls). asyncio rather than
Locust here: a bench runs one schedule per policy from inside the CLI
process, and Locust's gevent patching must not reach that process.

Times are seconds after the schedule's start (`t0`), so every record of a
run shares one clock with the arrivals.
"""

from __future__ import annotations

import asyncio
import time

from tokenflow.tools.loadtest.recorder import RequestRecorder, StreamError

CHAT_PATH = "/v1/chat/completions"


def chat_body(model: str, prompt: str, max_tokens: int, rate: float) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,  # fixed output length, as in the paper's workloads
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "consumption_rate": rate,
    }


async def read_answer(session, url: str, body: dict, rec: RequestRecorder, t0: float, timeout: float) -> None:
    """Stream one answer into `rec`; raises on HTTP, stream or time-out errors."""

    async def stream() -> None:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                raise StreamError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for line in resp.content:  # one SSE line at a time, as it arrives
                if rec.on_line(time.monotonic() - t0, line):
                    return
        raise StreamError("stream ended without [DONE]")

    try:
        await asyncio.wait_for(stream(), timeout)
    except asyncio.TimeoutError:
        raise TimeoutError(f"no complete answer within {timeout:g} s") from None


async def one_request(session, url: str, body: dict, rate: float, at: float, t0: float, timeout: float) -> dict:
    """Wait for the arrival time `at`, send, read; one JSON-ready record."""
    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
    rec, error = RequestRecorder(rate=rate, sent_at=time.monotonic() - t0), None
    try:
        await read_answer(session, url, body, rec, t0, timeout)
    except Exception as e:  # connection, HTTP, stream and time-out errors: all failures
        error = e
    rec.close(time.monotonic() - t0)
    return {"ok": error is None, "error": None if error is None else f"{type(error).__name__}: {error}",
            "scheduled_s": at, "sent_s": rec.sent_at, "arrivals_s": list(rec.reader.arrivals),
            **rec.result()}


async def run_schedule(base_url: str, bodies: list[dict], rates: list[float], offsets: list[float],
                       timeout: float, progress=None, api_key: str | None = None) -> list[dict]:
    """Every request of a schedule, each at its own offset; records in schedule order.
    `progress(record)` is called as each request ends; `api_key` goes out as a Bearer token."""
    import aiohttp

    url = base_url.rstrip("/") + CHAT_PATH
    # No connection limit (a burst opens every stream at once) and no
    # proxy from the environment: talk to the app directly.
    conn = aiohttp.TCPConnector(limit=0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(connector=conn, trust_env=False, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.monotonic()

        async def tracked(i: int) -> dict:
            record = await one_request(session, url, bodies[i], rates[i], offsets[i], t0, timeout)
            record["id"] = i
            if progress is not None:
                progress(record)
            return record

        return list(await asyncio.gather(*(tracked(i) for i in range(len(bodies)))))
