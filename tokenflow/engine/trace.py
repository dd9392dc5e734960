"""A per-decision trace of the scheduler, to find out why a request waited.

Off unless TOKENFLOW_TRACE_DIR names a directory in the EngineCore's
environment (a `serve run` or bench started with it set passes it down):
then each engine appends one JSON line per policy decision to
DIR/decisions-<pid>.jsonl: the engine's view, what was decided, and every
request the policy saw with its phase, buffer and rank key (tier, value).
It costs nothing when off; when on, a few hundred microseconds a decision.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenflow.core.policy import DEFAULT_SWAP_SHARE

TRACE_ENV = "TOKENFLOW_TRACE_DIR"
ID_CHARS = 12  # request ids are long; the tail tells them apart within a run


class DecisionTrace:
    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "a", buffering=1 << 16)

    @classmethod
    def from_env(cls) -> "DecisionTrace | None":
        directory = os.environ.get(TRACE_ENV)
        if not directory:
            return None
        Path(directory).mkdir(parents=True, exist_ok=True)
        return cls(Path(directory) / f"decisions-{os.getpid()}.jsonl")

    def record(self, now: float, cols, eng, decision, policy) -> None:
        """One line for a decision over `cols` (RequestColumns)."""
        keys = getattr(policy, "keys", None)  # TokenFlow's; Andes ranks otherwise
        share = decision.swap_share if decision is not None else DEFAULT_SWAP_SHARE  # the one the rank used
        work_end = decision.work_end_s if decision is not None else 0.0

        def short(ids):
            return [i[-ID_CHARS:] for i in ids]

        k = keys(cols, eng, share, work_end) if keys is not None else None
        rows = []
        for i, r in enumerate(cols.views()):
            tier, value = (int(k.tier[i]), round(float(k.value[i]), 4)) if k is not None else (None, None)
            rows.append([r.req_id[-ID_CHARS:], r.phase.value, round(r.buffer_s, 3), r.num_output, r.rate,
                         r.blocks, r.kv_resident, tier, value])
        line = {"t": round(now, 4),
                "engine": {"free_blocks": eng.free_blocks, "total_blocks": eng.total_blocks,
                           "host_blocks": eng.host_blocks, "max_num_seqs": eng.max_num_seqs,
                           "decode_tps": eng.decode_tps, "step_rate": eng.step_rate,
                           "prefill_tps": eng.prefill_tps, "transfer_tps": eng.transfer_tps, "start_s": eng.start_s,
                           "step_cost": eng.step_cost, "running": eng.running},
                "decided": decision is not None,
                "requests": rows,  # id, phase, buffer_s, tokens out, rate, blocks, resident, tier, value
                }
        if decision is not None:
            line.update(fallback=decision.fallback_fcfs, swap_share=decision.swap_share,
                        swap_budget=round(decision.swap_budget, 2),
                        run=short(decision.run), admit=short(decision.admit),
                        pause_hold=short(decision.pause_hold), pause_release=short(decision.pause_release),
                        defer=short(decision.defer), wait=short(decision.wait))
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()
