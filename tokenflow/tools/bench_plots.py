"""PNG plots for `tokenflow bench`: TTFT CDF, throughput and effective
throughput over time, sample token timelines (the paper's Fig. 15 style),
and buffer occupancy over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tokenflow.core.buffer import ReaderBuffer, buffer_at, token_weight  # noqa: E402


def _reader(rec: dict) -> ReaderBuffer:
    r = ReaderBuffer.replay(rec["rate"], rec["arrival_s"], rec["arrivals_s"])
    r.on_finish(rec["arrivals_s"][-1] if rec["arrivals_s"] else 0.0)
    return r


def write_plots(out: Path, records: dict[str, list[dict]], wl, bins: int = 40) -> list[Path]:
    paths = []
    # TTFT CDF
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, recs in records.items():
        xs = sorted(r["ttft_s"] for r in recs if r["ttft_s"] is not None)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    ax.legend()
    paths.append(_save(fig, out / "ttft_cdf.png"))

    # Throughput and effective throughput over time
    end = max((t for recs in records.values() for r in recs for t in r["arrivals_s"]), default=1.0)
    width = end / bins or 1.0
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, recs in records.items():
        raw, eff = [0.0] * bins, [0.0] * bins
        for rec in recs:
            reader = _reader(rec)
            n = len(rec["arrivals_s"])
            for t, b in zip(rec["arrivals_s"], reader.buffer_at_arrival):
                k = min(int(t / width), bins - 1)
                raw[k] += 1 / width
                eff[k] += token_weight(b, n) / width
        xs = [(k + 0.5) * width for k in range(bins)]
        line = ax.plot(xs, raw, label=f"{name} raw")[0]
        ax.plot(xs, eff, "--", color=line.get_color(), label=f"{name} effective")
    ax.set(xlabel="time (s)", ylabel="tokens/s", title="Throughput: raw (solid) vs effective (dashed)")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "throughput.png"))

    # Token timelines of sample requests (first, middle, last arrival)
    fig, axes = plt.subplots(1, len(records), figsize=(5 * len(records), 4), squeeze=False)
    for ax, (name, recs) in zip(axes[0], records.items()):
        for rec in [recs[0], recs[len(recs) // 2], recs[-1]]:
            ts = rec["arrivals_s"]
            ax.step(ts, range(1, len(ts) + 1), where="post", label=f"{rec['id']} generated")
            start = ts[0] if ts else 0
            ax.plot([start, start + len(ts) / rec["rate"]], [0, len(ts)], ":", color="grey")
        ax.set(title=f"{name}: tokens vs reading (dotted)", xlabel="time (s)", ylabel="tokens")
        ax.legend(fontsize=6)
    paths.append(_save(fig, out / "token_timelines.png"))

    # Buffer occupancy over time (mean seconds buffered across live readers)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, recs in records.items():
        readers = [_reader(rec) for rec in recs]
        xs = [(k + 0.5) * width for k in range(bins)]
        ys = []
        for t in xs:
            live = [r for r in readers if r.first_token_time is not None and r.first_token_time <= t
                    and r.arrivals and t <= r.arrivals[-1]]
            ys.append(sum(buffer_at(r.arrivals, r.rate, t) / r.rate for r in live) / len(live) if live else 0.0)
        ax.plot(xs, ys, label=name)
    ax.set(xlabel="time (s)", ylabel="mean buffer (s of reading)", title="Buffer occupancy")
    ax.legend()
    paths.append(_save(fig, out / "buffer_occupancy.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
