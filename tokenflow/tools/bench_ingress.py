"""`tokenflow bench-ingress`: what TokenFlow's ingress costs per streamed
message, beside stock Ray Serve LLM's, with no model in the way.

`tokenflow bench-serving` measures the whole path, but there every layer's
CPU per token follows how many tokens each message carries, i.e. how fast
each app's engines stream (Ray Serve LLM sends a stream's tokens once per
`stream_batching_interval_ms`), and on a small machine the engines' speed
moves from run to run. Here both ingresses stream from the same stand-in
engine (`StandInEngine`: canned chat chunks shaped as vLLM writes them, so
many tokens per message, no model), so both carry the same messages and
the difference is the ingress's own code: TokenFlow's guard, re-sends and
stream continuation (which asks the engine for token ids and strips them
again) against stock's `OpenAiIngress`.

One Ray cluster, one Serve HTTP proxy, two apps: `/stock` (stock's ingress
as `build_openai_app` makes it) and `/tokenflow` (the ingress
`tokenflow.serve.app` builds, from the default app args, slack routing
off: the stand-in pushes no engine state). Each round sends the same burst
to each app in turn, alternating which goes first, and reads the CPU time
of the ingress, the proxy and the stand-in around it.

OUT gets summary.json.
"""

from __future__ import annotations

import asyncio
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import psutil

from tokenflow.tools import launcher
from tokenflow.tools.bench_app import port_free

OURS, STOCK = "tokenflow", "stock"
MODEL = "stand-in"
ROLES = ("proxy", "ingress", "engine")


class StandInEngine:
    """A Serve LLM engine deployment without a model: chat streams of
    `tokens` tokens, `per_message` to a message (a list of SSE events, as
    Ray Serve LLM batches them), `gap_s` apart. Token ids go out when the
    request asks for them (as vLLM does with `return_token_ids`), usage
    at the end when `stream_options.include_usage` does."""

    def __init__(self, per_message: int, gap_s: float):
        self.per_message, self.gap_s = per_message, gap_s
        self.requests = self.asked_ids = 0

    async def stats(self) -> dict:
        """Requests streamed, and how many asked for token ids (TokenFlow's
        ingress does for every stream it can continue)."""
        return {"requests": self.requests, "asked_ids": self.asked_ids}

    async def llm_config(self):
        return None

    async def check_health(self):
        return None

    async def chat(self, body, raw_request_info=None):
        return self._stream(body)

    async def _stream(self, body):
        ids = bool(getattr(body, "return_token_ids", False))
        self.requests += 1
        self.asked_ids += ids
        opts = getattr(body, "stream_options", None)
        usage = bool(opts and getattr(opts, "include_usage", False))
        n = body.max_tokens or 16
        head = {"id": f"chatcmpl-{id(body):x}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": body.model}

        def event(delta: dict, i: int | None, finish: str | None = None, **extra) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                      "token_ids": [1000 + i] if ids and i is not None else None}
            return f"data: {json.dumps({**head, **extra, 'choices': [choice]}, separators=(',', ':'))}\n\n"

        yield [event({"role": "assistant", "content": ""}, None,
                     **({"prompt_token_ids": list(range(16))} if ids else {}))]
        i = 0
        while i < n:
            batch = []
            for i in range(i, min(n, i + self.per_message)):
                batch.append(event({"content": f" w{i}"}, i, "length" if i == n - 1 else None))
            i += 1
            if usage and i == n:
                u = {"prompt_tokens": 16, "completion_tokens": n, "total_tokens": 16 + n}
                batch.append(f"data: {json.dumps({**head, 'choices': [], 'usage': u}, separators=(',', ':'))}\n\n")
            yield batch
            await asyncio.sleep(self.gap_s)


def _apps(per_message: int, gap_s: float, app_args: dict | None = None):
    """(stock's ingress app, ours), each over its own stand-in engine."""
    from ray import serve
    from ray.serve.llm.ingress import OpenAiIngress, make_fastapi_ingress
    from tokenflow.serve import app as tf_app
    from tokenflow.serve.ray_private import ModelCard

    cards = {MODEL: ModelCard(id=MODEL, object="model", owned_by="tokenflow", permission=[], metadata={})}
    options = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}, "max_ongoing_requests": 10_000}

    def engine(app: str):
        return serve.deployment(StandInEngine, name=f"StandIn_{app}", num_replicas=1,
                                ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000).bind(
            per_message, gap_s)

    stock = serve.deployment(make_fastapi_ingress(OpenAiIngress), name="StockIngress", **options).bind(
        llm_deployments={MODEL: engine(STOCK)}, model_cards=cards)
    args = {"router": {"enabled": False}}
    for block, values in (app_args or {}).items():  # e.g. {"admission": {"max_continuations": 0}}
        args[block] = {**args.get(block, {}), **values} if isinstance(values, dict) else values
    a = tf_app.resolve_args(args)
    ours = tf_app.bind_ingress(a, {"name": "TokenFlowIngress", **options}, {MODEL: engine(OURS)}, cards, {})
    return stock, ours


def _processes() -> dict[tuple[str | None, str], list[psutil.Process]]:
    """(app, role) -> processes of this Ray cluster that a token crosses."""
    out: dict = {}
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or ())
        if cmd.startswith("ray::ProxyActor"):
            out.setdefault((None, "proxy"), []).append(p)
        for app in (OURS, STOCK):
            if f"ServeReplica:{app}:" in cmd:
                out.setdefault((app, "engine" if "StandIn" in cmd else "ingress"), []).append(p)
    return out


def _cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


async def _burst(url: str, streams: int, tokens: int, timeout: float) -> dict:
    """`streams` streaming chats at once; what the client got."""
    import aiohttp

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": tokens,
            "stream": True, "stream_options": {"include_usage": True}}

    async def one(session) -> int:
        got, done = 0, False
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: ") and b'"content":" w' in line:
                    got += 1
        if not done:
            raise RuntimeError("stream ended without [DONE]")
        return got

    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=False) as session:
        got = await asyncio.wait_for(asyncio.gather(*(one(session) for _ in range(streams))), timeout)
    return {"wall_s": time.monotonic() - t0, "tokens": sum(got), "complete": sum(g == tokens for g in got)}


def run_bench_ingress(out_dir: str, *, streams: int = 60, tokens: int = 512, per_message: int = 2,
                      gap_ms: float = 20.0, rounds: int = 3, port: int = 8019, timeout: float = 600.0,
                      app_args: dict | None = None, progress=None) -> dict:
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="tokenflow-bench-ingress")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        stock, ours = _apps(per_message, gap_ms / 1000, app_args)
        serve.run(stock, name=STOCK, route_prefix=f"/{STOCK}")
        serve.run(ours, name=OURS, route_prefix=f"/{OURS}")
        urls = {app: f"http://127.0.0.1:{port}/{app}/v1/chat/completions" for app in (OURS, STOCK)}
        for url in urls.values():  # first requests pay one-time costs
            asyncio.run(_burst(url, 4, 16, timeout))
        procs = _processes()
        rows = []
        for i in range(rounds):
            for app in ((OURS, STOCK) if i % 2 == 0 else (STOCK, OURS)):
                time.sleep(0.5)
                keys = [(None, "proxy"), (app, "ingress"), (app, "engine")]
                before = {k: _cpu(procs.get(k, [])) for k in keys}
                got = asyncio.run(_burst(urls[app], streams, tokens, timeout))
                spent = {k[1]: _cpu(procs.get(k, [])) - before[k] for k in keys}
                n = got["tokens"]
                row = {"round": i, "app": app, **got, "tokens_per_s": n / got["wall_s"],
                       "cpu_s": spent, "cpu_s_per_1k_tokens": {k: 1000 * v / n if n else None
                                                               for k, v in spent.items()}}
                rows.append(row)
                if progress is not None:
                    progress(row)
        engines = {app: serve.get_deployment_handle(f"StandIn_{app}", app_name=app).stats.remote().result()
                   for app in (OURS, STOCK)}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    summary = {"workload": {"streams": streams, "tokens": tokens, "tokens_per_message": per_message,
                            "gap_ms": gap_ms, "rounds": rounds, "app_args": app_args or {}},
               "rows": rows, "ratios": ratios(rows), "engines": engines}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def ratios(rows: list[dict]) -> dict:
    """Ours over stock, per round and the median: each role's CPU per
    token, and throughput."""
    per_round = []
    for i in sorted({r["round"] for r in rows}):
        a, b = (next(r for r in rows if r["round"] == i and r["app"] == app) for app in (OURS, STOCK))
        ratio = {role: a["cpu_s_per_1k_tokens"][role] / b["cpu_s_per_1k_tokens"][role]
                 for role in ROLES if a["cpu_s_per_1k_tokens"][role] and b["cpu_s_per_1k_tokens"][role]}
        ratio["tokens_per_s"] = a["tokens_per_s"] / b["tokens_per_s"]
        per_round.append(ratio)
    keys = set().union(*per_round) if per_round else set()
    return {"per_round": per_round,
            "median": {k: statistics.median(r[k] for r in per_round if k in r) for k in sorted(keys)}}


def table(summary: dict) -> str:
    """CPU seconds per 1,000 tokens by role (medians over rounds), and throughput."""
    from tokenflow.tools.bench_serving import _median_over_rounds

    med = functools.partial(_median_over_rounds, summary)

    lines = [f"| role | {OURS} | {STOCK} | ratio |", "| --- | --- | --- | --- |"]
    for role in ROLES:
        a, b = (med(app, lambda r: r["cpu_s_per_1k_tokens"][role] or 0.0) for app in (OURS, STOCK))
        lines.append(f"| {role} | {a:.3f} | {b:.3f} | {summary['ratios']['median'].get(role, float('nan')):.2f}x |")
    a, b = (med(app, lambda r: r["tokens_per_s"]) for app in (OURS, STOCK))
    lines.append(f"| tokens/s | {a:,.0f} | {b:,.0f} | {summary['ratios']['median']['tokens_per_s']:.2f}x |")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--streams", type=int, default=60, help="streams per burst")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per stream")
    parser.add_argument("--tokens-per-message", type=int, default=2,
                        help="tokens the stand-in engine sends per message (Ray Serve LLM's 50 ms batches "
                             "carried 2.2-2.9 per stream in bench-serving's bursts on 2 cores)")
    parser.add_argument("--gap-ms", type=float, default=20.0, help="the stand-in's pause between messages")
    parser.add_argument("--rounds", type=int, default=3, help="bursts per app, alternating which app goes first")
    parser.add_argument("--port", type=int, default=8019)
    parser.add_argument("--app-args", default="{}",
                        help="JSON merged into TokenFlow's app args by block, e.g. "
                             "'{\"admission\": {\"max_continuations\": 0}}' to see what a feature costs")
    parser.add_argument("--out", default="out/bench-ingress")


def run(args) -> int:
    launcher.stop_on_signals()
    for name in ("streams", "tokens", "tokens_per_message", "rounds"):
        if getattr(args, name) < 1:
            print(f"tokenflow bench-ingress: error: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if not args.gap_ms >= 0:
        print("tokenflow bench-ingress: error: --gap-ms must be at least 0", file=sys.stderr)
        return 2
    if (app_args := launcher.app_args_arg("bench-ingress", args.app_args)) is None:
        return 2
    if not port_free("127.0.0.1", args.port):
        print(f"tokenflow bench-ingress: error: port {args.port} is in use", file=sys.stderr)
        return 2

    def progress(row: dict) -> None:
        print(json.dumps({k: row[k] for k in ("round", "app", "tokens", "complete", "tokens_per_s",
                                              "cpu_s_per_1k_tokens")}), flush=True)

    summary = run_bench_ingress(args.out, streams=args.streams, tokens=args.tokens,
                                per_message=args.tokens_per_message, gap_ms=args.gap_ms, rounds=args.rounds,
                                port=args.port, app_args=app_args, progress=progress)
    print(table(summary))
    print(f"summary: {Path(args.out) / 'summary.json'}")
    return 0
