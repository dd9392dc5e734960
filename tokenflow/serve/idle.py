"""Detached actors that remove themselves once unused (a node's KV pool, the
state boards, the node relays)."""

import threading
import time

import ray


def exit_when_idle(period_s: float) -> None:
    """Start a thread that asks the actor it runs in, every `period_s`,
    whether it is idle (its `exit_if_idle`, which ends it if so). The check
    is an actor call, so it is serialized with the actor's other calls and
    never races them over the actor's state."""
    def watch() -> None:
        me = ray.get_runtime_context().current_actor
        while True:
            time.sleep(period_s)
            try:
                ray.get(me.exit_if_idle.remote())
            except Exception:
                return  # exiting
    threading.Thread(target=watch, daemon=True, name="tokenflow-idle").start()
