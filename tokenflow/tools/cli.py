"""`tokenflow` command line: tiny-model, serve, bench, loadtest, soak, dashboards."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_tiny_model(args) -> int:
    from tokenflow.tools.tiny_model import make_tiny_model

    out = make_tiny_model(args.dir, seed=args.seed, force=args.force)
    print(f"tiny model ready in {out}")
    return 0


def _cmd_serve(args) -> int:
    from tokenflow.tools.launcher import serve

    return serve(args.config, host=args.host, port=args.port, timeout=args.timeout)


def _cmd_bench_policy(args) -> int:
    from tokenflow.tools.bench_policy import compare, main

    if args.against:
        compare(args.against, population_name=args.population)
    else:
        main(sizes=args.sizes, repeats=args.repeats, population_name=args.population)
    return 0


def _cmd_bench(args) -> int:
    import json

    from tokenflow.tools.bench import EngineSettings, Workload, run_bench

    wl = Workload(kind=args.workload, requests=args.requests, poisson_rate=args.poisson_rate,
                  gamma_cv=args.gamma_cv,
                  rates=args.rates, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                  seed=args.seed)
    wl.arrivals()  # validates the kind before any engine starts
    eng = EngineSettings(model=args.model, kv_cache_memory_bytes=args.kv_bytes or None,
                         max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                         block_size=args.block_size or None, offload_bytes=args.offload_bytes,
                         extra=json.loads(args.engine_args),
                         tokenflow={"dt": 0.1, **json.loads(args.tokenflow)}, scheduling=args.scheduling)
    summary = run_bench(args.out, wl, eng, schedulers=args.schedulers, plots=not args.no_plots, load=args.load,
                        rounds=args.rounds, lockstep=args.lockstep)
    print(json.dumps(summary.get("ratios_tokenflow_vs_fcfs", {})))
    print(f"wrote {args.out}/summary.json")
    return 0


def _loadtest(module: str = "runner"):
    import importlib

    return importlib.import_module(f"tokenflow.tools.loadtest.{module}")


def _cmd_loadtest(args) -> int:
    return _loadtest().run(args)


def _cmd_soak(args) -> int:
    return _loadtest("soak").run(args)


def _cmd_bench_app(args) -> int:
    _loadtest("shapes")  # tokenflow/tools/loadtest/ importable, as for loadtest
    from tokenflow.tools import bench_app

    return bench_app.run(args)


def _cmd_bench_serving(args) -> int:
    _loadtest("shapes")
    from tokenflow.tools import bench_serving

    return bench_serving.run(args)


def _cmd_bench_ingress(args) -> int:
    from tokenflow.tools import bench_ingress

    return bench_ingress.run(args)


def _cmd_bench_router(args) -> int:
    from tokenflow.tools import bench_router

    return bench_router.run(args)


def _cmd_bench_rebalance(args) -> int:
    from tokenflow.tools import bench_rebalance

    return bench_rebalance.run(args)


def _dashboards_module():
    # dashboards/ sits beside tokenflow/ in the checkout (not an installed package).
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "dashboards" / "generate.py"
    if not path.is_file():
        raise OSError(f"no dashboard generator at {path} (run from a TokenFlow checkout)")
    spec = importlib.util.spec_from_file_location("tokenflow_dashboards_generate", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cmd_config_schema(args) -> int:
    from tokenflow.serve.settings import json_schema

    sys.stdout.write(json_schema())
    return 0


def _cmd_dashboards(args) -> int:
    from pathlib import Path

    gen = _dashboards_module()
    if args.action == "generate":
        for path in gen.write(Path(args.dir) if args.dir else gen.OUT_DIR):
            print(f"wrote {path}")
        return 0
    return push_dashboards(args.url, args.token, Path(args.dir) if args.dir else gen.OUT_DIR,
                           folder_uid=args.folder_uid, timeout=args.timeout)


def push_dashboards(url: str, token: str | None, directory, folder_uid: str | None = None,
                    timeout: float = 10.0) -> int:
    """Upload every dashboards/*.json to Grafana (overwriting by uid)."""
    import niquests
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaException

    files = sorted(directory.glob("*.json"))
    if not files:
        print(f"tokenflow: error: no dashboard JSON in {directory}", file=sys.stderr)
        return 2
    try:
        api = GrafanaApi.from_url(url, credential=token or None, timeout=timeout)
        api.health.check()
    except (GrafanaException, niquests.exceptions.RequestException, OSError, ValueError) as e:
        print(f"tokenflow: error: cannot reach Grafana at {url}: {e}", file=sys.stderr)
        return 1
    for path in files:
        body = {"dashboard": json.loads(path.read_text()), "overwrite": True,
                "message": "tokenflow dashboards push"}
        if folder_uid:
            body["folderUid"] = folder_uid
        try:
            res = api.dashboard.update_dashboard(body)
        except (GrafanaException, niquests.exceptions.RequestException, OSError) as e:
            print(f"tokenflow: error: Grafana at {url} refused {path.name}: {e}", file=sys.stderr)
            return 1
        print(f"pushed {path.name}: {url.rstrip('/')}{res.get('url', '')}")
    return 0


def _positive_int(s: str) -> int:
    v = int(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s}")
    return v


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenflow", description="TokenFlow: buffer-aware LLM streaming serving")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("tiny-model", help="write a tiny Llama model directory (no download)")
    t.add_argument("dir", nargs="?", default="models/tiny-llama")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    t.set_defaults(func=_cmd_tiny_model)

    s = sub.add_parser("serve", help="run the Ray Serve app in the foreground (Ctrl-C stops it)")
    s.add_argument("config", nargs="?", default="configs/local.yaml")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the engines")
    s.set_defaults(func=_cmd_serve)
    b = sub.add_parser("bench-policy", help="time one policy decision at several population sizes")
    b.add_argument("--sizes", type=int, nargs="+", default=[100, 400, 1000])
    b.add_argument("--repeats", type=int, default=500)
    b.add_argument("--against", metavar="POLICY_PY",
                   help="A/B at 400 requests against another version of tokenflow/core/policy.py")
    b.add_argument("--population", choices=["burst", "stalling"], default="burst",
                   help="burst: a burst in progress; stalling: readers at their resume level "
                        "behind guarded readers in every slot")
    b.set_defaults(func=_cmd_bench_policy)
    c = sub.add_parser("bench", help="same workload under fcfs, andes and tokenflow, side by side")
    c.add_argument("--out", default="out/bench")
    c.add_argument("--schedulers", nargs="+", default=["fcfs", "andes", "tokenflow"],
                   choices=["fcfs", "andes", "tokenflow"])
    c.add_argument("--workload", choices=["burst", "poisson", "gamma"], default="burst")
    c.add_argument("--requests", type=_positive_int, default=128)
    c.add_argument("--poisson-rate", type=_positive_float, default=8.0,
                   help="requests/s for --workload poisson or gamma")
    c.add_argument("--gamma-cv", type=_positive_float, default=2.0,
                   help="gamma arrivals: coefficient of variation of the gaps (1 = Poisson)")
    c.add_argument("--load", type=_positive_float,
                   help="size the workload to this share of the engine's decode capacity, measured first: "
                        "a burst gets as many readers as read LOAD x capacity; poisson/gamma arrivals "
                        "bring LOAD x capacity tokens/s (overrides --requests or --poisson-rate)")
    c.add_argument("--rates", type=_positive_float, nargs="+", default=[10.0, 20.0, 40.0],
                   help="reading rates (tokens/s) drawn per request")
    c.add_argument("--prompt-tokens", type=_positive_int, default=64)
    c.add_argument("--output-tokens", type=_positive_int, default=1024)
    c.add_argument("--seed", type=int, default=0,
                   help="the workload's seed; it also rotates the order the schedulers run in (seeds 0, 1, 2: each first once)")
    c.add_argument("--rounds", type=_positive_int, default=1,
                   help="the schedulers take turns this many times, a new workload (seed + round) each round and "
                        "the order rotated; figures pooled over the rounds (a drifting machine slows all alike)")
    c.add_argument("--lockstep", action="store_true",
                   help="run a round's schedulers at once, taking turns of one engine step each, each timed on "
                        "the clock of its own engine's work: a machine that slows for a while slows all alike")
    c.add_argument("--model", default="models/tiny-llama")
    c.add_argument("--kv-bytes", type=int, default=32 << 20, help="KV pool bytes (0: vLLM's default)")
    c.add_argument("--offload-bytes", type=int, default=256 << 20,
                   help="host KV tier per engine, same for every scheduler (0: none)")
    c.add_argument("--max-num-seqs", type=_positive_int, default=32)
    c.add_argument("--max-model-len", type=_positive_int, default=2048)
    c.add_argument("--block-size", type=int, default=32, help="0: vLLM's default")
    c.add_argument("--engine-args", default="{}", help="JSON of extra vLLM engine args")
    c.add_argument("--tokenflow", default="{}", help="JSON of TokenFlowConfig overrides (dt defaults to 0.1 here)")
    c.add_argument("--scheduling", choices=["auto", "sync", "async"], default="auto",
                   help="vLLM scheduling mode of every scheduler alike; auto: async on GPU, sync on CPU")
    c.add_argument("--no-plots", action="store_true")
    c.set_defaults(func=_cmd_bench)
    ba = sub.add_parser("bench-app", help="the same comparison end to end: the served app started per policy, "
                                          "streaming readers over HTTP")
    _loadtest("shapes")
    from tokenflow.tools import bench_app

    bench_app.add_arguments(ba)
    ba.set_defaults(func=_cmd_bench_app)
    bs = sub.add_parser("bench-serving", help="the serving path's CPU per streamed token by role, "
                                              "TokenFlow's app beside stock Ray Serve LLM in one run")
    from tokenflow.tools import bench_serving

    bench_serving.add_arguments(bs)
    bs.set_defaults(func=_cmd_bench_serving)
    bi = sub.add_parser("bench-ingress", help="TokenFlow's ingress beside stock Ray Serve LLM's, CPU per streamed "
                                              "token, both fed by one stand-in engine (no model)")
    from tokenflow.tools import bench_ingress

    bench_ingress.add_arguments(bi)
    bi.set_defaults(func=_cmd_bench_ingress)
    br = sub.add_parser("bench-router", help="the slack router at cluster scale: real state boards and ingress "
                                             "routing against N stand-in engines (docs/SCALING.md)")
    from tokenflow.tools import bench_router

    bench_router.add_arguments(br)
    br.set_defaults(func=_cmd_bench_router)
    bb = sub.add_parser("bench-rebalance", help="a burst piled onto one engine, with and without moving paused "
                                                "streams to the idle ones, in one run")
    from tokenflow.tools import bench_rebalance

    bench_rebalance.add_arguments(bb)
    bb.set_defaults(func=_cmd_bench_rebalance)
    d = sub.add_parser("dashboards", help="Grafana dashboards: regenerate the JSON, or push it to a Grafana")
    d.add_argument("action", choices=["generate", "push"])
    d.add_argument("--url", help="Grafana base URL, e.g. http://127.0.0.1:3000 (push)")
    d.add_argument("--token", help="Grafana service account token (push)")
    d.add_argument("--dir", help="dashboard JSON directory (default: the checkout's dashboards/)")
    d.add_argument("--folder-uid", help="Grafana folder to put them in (push; default: General)")
    d.add_argument("--timeout", type=_positive_float, default=10.0, help="seconds per Grafana request")
    d.set_defaults(func=_cmd_dashboards)
    cs = sub.add_parser("config-schema", help="print the JSON schema of the app's args (docs/config-schema.json)")
    cs.set_defaults(func=_cmd_config_schema)
    lt = sub.add_parser("loadtest", help="streaming readers against a running app, with Locust (headless)")
    _loadtest().add_arguments(lt)
    lt.set_defaults(func=_cmd_loadtest)
    sk = sub.add_parser("soak", help="requests in bursts against a running app: none lost, memory flat")
    _loadtest("soak").add_arguments(sk)
    sk.set_defaults(func=_cmd_soak)
    # Listed for --help; main() hands its arguments to tokenflow/tools/gpu_check.py.
    sub.add_parser("gpu-check", help="check the GPU path on a CUDA machine (scripts/gpu_check.sh); "
                                     "--tiny: the same on CPU with the tiny model")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu-check"]:
        from tokenflow.tools import gpu_check

        return gpu_check.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "dashboards" and args.action == "push" and not args.url:
        parser.error("dashboards push needs --url")
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # JSONDecodeError is a ValueError
        print(f"tokenflow: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
