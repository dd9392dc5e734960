"""A bounded soak against a running app: requests in bursts, nothing lost,
memory flat (`tokenflow soak`).

Each request is one of four kinds in turn (streamed or whole, completions or
chat), greedy with `ignore_eos` so its length is known. Its outcome is
  ok      200 and every token: usage says max_tokens, a stream ends [DONE]
  error   an explicit error: 4xx/5xx with a JSON body, or an SSE error event
  lost    anything else: a cut connection, a timeout, a short answer
The resident memory of every local Ray and vLLM process is read after the
warm-up and after every later burst; growth is relative to warm-up.

The warm-up first sweeps step sizes: one-token requests with prompts of 1 to
`warmup_shapes` words, twice over, eight at a time (so every engine gets
its share). vLLM's CPU engine caches compiled
matmul kernels per step size (oneDNN primitives, a bounded LRU per layer),
so its worker grows with every new step size until those caches are full,
then stays flat (measured: +330 MiB over the first 300 sizes, nothing over
the next 500, docs/RELIABILITY.md). Bursts alone reach new sizes slowly,
which looked like a creep. The sweep's requests are counted apart.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx
import psutil

KINDS = ("stream-completion", "completion", "stream-chat", "chat")


@dataclass
class SoakSettings:
    url: str = "http://127.0.0.1:8000"
    model: str = "tiny-llama"
    requests: int = 2000
    burst: int = 48  # at once; keep under admission.max_ongoing_requests to expect no 429
    warmup_requests: int = 200  # memory is measured from here on
    warmup_shapes: int = 400  # step sizes swept first (see the module docstring); 0: none
    max_tokens: tuple[int, int] = (8, 48)
    timeout_s: float = 300.0
    seed: int = 0
    rss_tolerance: float = 0.10


@dataclass
class SoakReport:
    outcomes: dict = field(default_factory=lambda: {"ok": 0, "error": 0, "lost": 0})
    errors: dict = field(default_factory=dict)  # "status: message" -> count
    lost: list = field(default_factory=list)  # the first few, why
    seconds: float = 0.0
    tokens: int = 0
    # label -> MiB after each burst from warm-up on; the first is the baseline
    rss_trace: dict = field(default_factory=dict)
    warmup_outcomes: dict = field(default_factory=lambda: {"ok": 0, "error": 0, "lost": 0})

    @property
    def rss_mib_after_warmup(self) -> dict:
        return {k: t[0] for k, t in self.rss_trace.items()}

    @property
    def rss_mib_end(self) -> dict:
        return {k: t[-1] for k, t in self.rss_trace.items()}

    @property
    def rss_growth_max(self) -> dict:
        """label -> worst sample relative to the baseline."""
        return {k: round(max(t) / t[0] - 1, 4) for k, t in self.rss_trace.items() if t[0]}

    @property
    def worst_growth(self) -> float:
        return max(self.rss_growth_max.values(), default=0.0)

    def to_dict(self) -> dict:
        return {**asdict(self), "rss_mib_after_warmup": self.rss_mib_after_warmup,
                "rss_mib_end": self.rss_mib_end, "rss_growth_max": self.rss_growth_max,
                "worst_rss_growth": round(self.worst_growth, 4)}


def serving_processes() -> dict[str, int]:
    """label -> pid of this machine's Ray workers and vLLM engine processes
    (idle pooled Ray workers excluded: they come and go)."""
    out = {}
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or ())
            name = p.info["name"] or ""
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if cmd.startswith("ray::"):
            title = cmd
        elif name.startswith(("ray::", "VLLM")) or name in ("gcs_server", "raylet"):
            title = name
        else:
            continue
        if title.startswith("ray::IDLE"):
            continue
        # "ray::ServeController.listen_for_change": the part after the dot
        # is the method running now.
        out[f"{title.split()[0].split('.')[0]}#{p.info['pid']}"] = p.info["pid"]
    return out


def rss_mib(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for label, pid in pids.items():
        try:
            out[label] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return out


def _body(kind: str, i: int, n_tokens: int, s: SoakSettings, rate: float) -> dict:
    body = {"model": s.model, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True,
            "consumption_rate": rate}
    text = f"Soak {i}: the reader and the river"
    if kind.endswith("chat"):
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if kind.startswith("stream"):
        body.update(stream=True, stream_options={"include_usage": True})
    return body


async def one(client: httpx.AsyncClient, kind: str, body: dict) -> tuple[str, str, int]:
    """(outcome, detail, tokens) of one request."""
    path = "/v1/chat/completions" if kind.endswith("chat") else "/v1/completions"
    want = body["max_tokens"]
    try:
        if not body.get("stream"):
            r = await client.post(path, json=body)
            if r.status_code != 200:
                return _error(r.status_code, r.text)
            got = r.json()["usage"]["completion_tokens"]
            return ("ok", "", got) if got == want else ("lost", f"{got} of {want} tokens", got)
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return _error(r.status_code, (await r.aread()).decode(errors="replace"))
            done, got, err = False, None, None
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    ev = json.loads(line[6:])
                    err = ev.get("error") or err
                    if ev.get("usage"):
                        got = ev["usage"]["completion_tokens"]
            if err is not None:
                return "error", f"stream: {err.get('message', err)}"[:200], got or 0
            if done and got == want:
                return "ok", "", got
            return "lost", f"stream ended done={done} with {got} of {want} tokens", got or 0
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        return "lost", repr(e)[:200], 0


def _error(status: int, text: str) -> tuple[str, str, int]:
    try:
        msg = json.loads(text)
        msg = (msg.get("error") or {}).get("message") or msg.get("detail") or text
    except (json.JSONDecodeError, AttributeError):
        return "lost", f"{status} without a JSON body: {text[:100]}", 0
    return "error", f"{status}: {str(msg)[:120]}", 0


async def soak(s: SoakSettings, on_burst=None) -> SoakReport:
    rng = random.Random(s.seed)
    rep = SoakReport()
    pids: dict[str, int] = {}
    limits = httpx.Limits(max_connections=s.burst, max_keepalive_connections=s.burst)
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=s.url, timeout=s.timeout_s, limits=limits) as client:
        await sweep_shapes(client, s, rng, rep)
        sent = 0
        while sent < s.requests:
            n = min(s.burst, s.requests - sent)
            jobs = []
            for i in range(sent, sent + n):
                kind = KINDS[i % len(KINDS)]
                body = _body(kind, i, rng.randint(*s.max_tokens), s, rng.choice((5.0, 10.0, 20.0, 40.0)))
                jobs.append(one(client, kind, body))
            for outcome, detail, tokens in await asyncio.gather(*jobs):
                rep.outcomes[outcome] += 1
                rep.tokens += tokens
                if outcome == "error":
                    rep.errors[detail] = rep.errors.get(detail, 0) + 1
                elif outcome == "lost" and len(rep.lost) < 10:
                    rep.lost.append(detail)
            sent += n
            _sample_memory(rep, s, sent, pids)
            if on_burst is not None:
                on_burst(sent, rep)
    rep.seconds = round(time.monotonic() - start, 2)
    return rep


WORDS = ("river", "mountain", "reader", "stream", "buffer", "token", "cloud", "forest", "light", "stone",
         "window", "garden", "engine", "harbor", "violet", "winter")


SWEEP_AT_ONCE = 8


async def sweep_shapes(client: httpx.AsyncClient, s: SoakSettings, rng: random.Random, rep: SoakReport) -> None:
    """Prompts of 1..warmup_shapes words (random words: no shared prefix for
    the prefix cache to shorten), one token each, twice over in random
    order, SWEEP_AT_ONCE at a time: the router spreads them over the engines,
    and each step's size is a new mix."""
    sizes = list(range(1, s.warmup_shapes + 1)) * 2
    rng.shuffle(sizes)
    for i in range(0, len(sizes), SWEEP_AT_ONCE):
        jobs = []
        for n in sizes[i:i + SWEEP_AT_ONCE]:
            body = {"model": s.model, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
                    "prompt": " ".join(rng.choice(WORDS) for _ in range(n))}
            jobs.append(one(client, "completion", body))
        for outcome, _, _ in await asyncio.gather(*jobs):
            rep.warmup_outcomes[outcome] += 1


def _sample_memory(rep: SoakReport, s: SoakSettings, sent: int, pids: dict[str, int]) -> None:
    if sent < s.warmup_requests:
        return
    if not pids:  # the first sample after warm-up is the baseline
        pids.update(serving_processes())
    for k, v in rss_mib(pids).items():  # a process that exited has no new sample
        rep.rss_trace.setdefault(k, []).append(round(v, 1))


def add_arguments(p) -> None:
    d = SoakSettings()
    p.add_argument("--url", default=d.url)
    p.add_argument("--model", default=d.model)
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--burst", type=int, default=d.burst)
    p.add_argument("--warmup-requests", type=int, default=d.warmup_requests)
    p.add_argument("--warmup-shapes", type=int, default=d.warmup_shapes)
    p.add_argument("--rss-tolerance", type=float, default=d.rss_tolerance)
    p.add_argument("--out", default=None, help="write the report here as JSON")


def run(args) -> int:
    if args.requests < 1 or args.burst < 1 or args.warmup_requests < 0 or args.warmup_shapes < 0:
        print("tokenflow soak: --requests and --burst must be >= 1, --warmup-requests and --warmup-shapes >= 0")
        return 2
    s = SoakSettings(url=args.url.rstrip("/"), model=args.model, requests=args.requests, burst=args.burst,
                     warmup_requests=args.warmup_requests, warmup_shapes=args.warmup_shapes,
                     rss_tolerance=args.rss_tolerance)

    def progress(sent: int, rep: SoakReport) -> None:
        print(f"{sent}/{s.requests} sent: {rep.outcomes}", flush=True)

    rep = asyncio.run(soak(s, progress))
    report = rep.to_dict()
    print(json.dumps({k: v for k, v in report.items() if k != "rss_trace"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    ok = rep.outcomes["lost"] == 0 and rep.worst_growth <= s.rss_tolerance
    print(f"tokenflow soak: {'PASS' if ok else 'FAIL'}: {rep.outcomes}, "
          f"worst RSS growth {100 * rep.worst_growth:.1f}% (limit {100 * s.rss_tolerance:.0f}%)")
    return 0 if ok else 1
