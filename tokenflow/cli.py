"""`tokenflow` command line: tiny-model, serve."""

from __future__ import annotations

import argparse
import sys


def _cmd_tiny_model(args) -> int:
    from tokenflow.tiny_model import make_tiny_model

    out = make_tiny_model(args.dir, seed=args.seed, force=args.force)
    print(f"tiny model ready in {out}")
    return 0


def _cmd_serve(args) -> int:
    from tokenflow.launcher import serve

    return serve(args.config, host=args.host, port=args.port, timeout=args.timeout)


def _cmd_bench_policy(args) -> int:
    from tokenflow.bench_policy import main as bench

    bench(sizes=args.sizes, repeats=args.repeats)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenflow", description="TokenFlow: buffer-aware LLM streaming serving")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("tiny-model", help="write a tiny Llama model directory (no download)")
    t.add_argument("dir", nargs="?", default="models/tiny-llama")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    t.set_defaults(func=_cmd_tiny_model)

    s = sub.add_parser("serve", help="run the Ray Serve app in the foreground (Ctrl-C stops it)")
    s.add_argument("config", nargs="?", default="deployments/configs/local.yaml")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the engines")
    s.set_defaults(func=_cmd_serve)
    b = sub.add_parser("bench-policy", help="time one policy decision at several population sizes")
    b.add_argument("--sizes", type=int, nargs="+", default=[100, 400, 1000])
    b.add_argument("--repeats", type=int, default=500)
    b.set_defaults(func=_cmd_bench_policy)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"tokenflow: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
