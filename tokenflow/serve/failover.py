"""What happens to a request whose engine dies under it.

An engine is lost when its replica dies (Ray's actor errors on the handle's
stream) or when its vLLM EngineCore dies with the replica alive (the
replica then raises EngineLost: `bounce_if_engine_dead`). A request that
has not delivered a token yet is re-sent (Serve's router has already
dropped a dead replica, and a replica without an engine has left the slack
routing, so the next attempt goes elsewhere); the client sees at most a
later first token. A stream that has delivered tokens cannot be replayed
without repeating them: it is continued on another engine from where it
was (continuation.py) where that can be done, else it ends with an explicit
SSE error event (then `[DONE]`), never a silent hang or a cut connection;
so does a stream cut by any other error once tokens went out.

Chunks with no token (a chat stream's opening role chunk) are held back
until the first token arrives, so a re-send never shows the client a second
opening.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Awaitable, Callable

from ray import exceptions as ray_exceptions

from tokenflow.core.config import PIN_KEY
from tokenflow.serve.sse import answer_over, count_chunk, moved_to, sse_events

logger = logging.getLogger("ray.serve")


class EngineLost(RuntimeError):
    """Raised by a replica whose vLLM EngineCore has died: the request never
    started there and may be re-sent to another engine."""


# How a dead or unreachable replica, or a replica without its engine, shows
# up on a Serve handle's stream. ActorDiedError is a RayActorError.
REPLICA_LOST = (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError, EngineLost)

LOST_MESSAGE = "the engine serving this request failed"
LOST_MID_STREAM = f"{LOST_MESSAGE} mid-stream; the response is incomplete"
FAILED_MESSAGE = "the request failed mid-stream; the response is incomplete"
CORE_DIED = "the engine core of this replica has died"
STOPPING = "Serve is stopping this replica (a redeploy or a scale-down)"
MOVED = "this engine is busier than others: the stream moves to one with room"


def engine_lost(e: BaseException) -> bool:
    """Whether an error on a handle's stream means the engine is gone. A
    replica's own exception arrives as a RayTaskError that is also an
    instance of its cause's class; the cause is checked too in case it is not."""
    return isinstance(e, REPLICA_LOST) or isinstance(getattr(e, "cause", None), EngineLost)


def carries_token(item) -> bool:
    # Whole responses and error objects are the answer itself.
    if not isinstance(item, (str, bytes, list, tuple)):
        return True
    return count_chunk(item)[0] > 0


def lost_event(message: str, type_: str = "ServiceUnavailableError", code: int = 503) -> str:
    """The SSE event a stream ends with when it cannot go on (the shape
    OpenAI clients raise as an APIError); [DONE] follows (Serve LLM's
    stream wrapper adds it)."""
    err = {"error": {"message": message, "type": type_, "code": code}}
    return f"data: {json.dumps(err)}\n\n"


def is_error_event(item) -> bool:
    """Whether a streamed chunk (an SSE string or a batch of them) carries
    an error event, as vLLM's stream generators yield one on failure."""
    if isinstance(item, (list, tuple)):
        return any(is_error_event(x) for x in item)
    return isinstance(item, str) and '"error"' in item and any("error" in ev for ev in sse_events(item))


def unavailable_response(message: str):
    """An ErrorResponse the ingress turns into an HTTP 503 JSON body."""
    from ray.serve.llm.openai_api_models import ErrorResponse

    from tokenflow.serve.ray_private import ErrorInfo

    return ErrorResponse(error=ErrorInfo(message=message, type="ServiceUnavailableError", code=503))


# What became of a request whose replica was lost (counted by the ingress),
# and why it was lost: the engine failed, Serve stopped its replica, or its
# engine moved the stream to one with slack (routing/rebalance.py).
# "finished": the loss came after the answer's last token and finish reason
# went out, so the ingress closed the stream itself.
OUTCOMES = ("resent", "continued", "finished", "ended_mid_stream", "gave_up")
CAUSES = ("failure", "shutdown", "rebalance")


def unpinned(body):
    """The request for a re-send: without the engine it named
    (`tokenflow_engine`), which is the one just lost (the slack routing
    picks another); the request itself when it named none."""
    extra = getattr(body, "model_extra", None)
    if not extra or PIN_KEY not in extra:
        return body
    body = body.model_copy()
    body.model_extra.pop(PIN_KEY)
    return body


def loss_cause(e: BaseException) -> str:
    # Through a handle the replica's EngineLost arrives as Ray's
    # RayTaskError(EngineLost): an EngineLost too, whose own text is Ray's
    # traceback; the replica's exception is its `cause`.
    lost = getattr(e, "cause", None) or e
    if isinstance(lost, EngineLost):
        text = str(lost)
        if STOPPING in text:
            return "shutdown"
        if MOVED in text:
            return "rebalance"
    return "failure"


async def relay(open_stream: Callable[[], AsyncIterator], resends: int,
                on_lost: Callable[[str, str], None] | None = None, resend_after_s: float = 0.0,
                abandon: Callable[[], Awaitable[None]] | None = None,
                continue_after: Callable[[str | None], Callable[[], AsyncIterator] | None] | None = None,
                closing: Callable[[], list | None] | None = None) -> AsyncIterator:
    """Yield the items of open_stream(). When the replica is lost before any
    token went out, re-open it (at most `resends` times); after tokens went
    out, ask continue_after(to) for a stream that continues the answer on
    another engine (continuation.py; `to`: the engine its engine moved it
    to, else None), or None: the stream then ends with the
    lost-engine error event. Either goes `resend_after_s` later, but for a
    stream its engine moved to a named one (time for
    the routing to hear of the loss: re-sent at once, a request can go
    straight back to an engine that has just lost its core). on_lost hears
    each loss as one of OUTCOMES and one of CAUSES; abandon() is awaited before each new
    attempt, to cancel what the lost one may still be doing (an unreachable
    replica is not always a dead one). closing() gives the chunks that end
    a stream whose whole answer went out already (continuation.py), else
    None: such a stream is closed with them, not continued or cut."""
    flowing, resent = False, 0
    while True:
        held: list = []
        to = None  # where this attempt's engine moved the stream, if it did
        try:
            async for item in open_stream():
                if (to := moved_to(item)) is not None:
                    # Its engine handed the stream to engine `to` (routing/rebalance.py).
                    for x in item[:-1] if isinstance(item, list) else ():
                        yield x
                    raise EngineLost(MOVED)
                if flowing:
                    yield item
                    continue
                held.append(item)
                if carries_token(item):
                    flowing = True
                    for x in held:
                        yield x
                    held = []
            for x in held:  # ended without a token (e.g. max_tokens=0)
                yield x
            return
        except Exception as e:
            if flowing and closing is not None and (last := closing()) is not None:
                # Only what follows the last token was lost (a replica
                # stopped or died between the two): close the stream here.
                if engine_lost(e) and on_lost is not None:
                    on_lost("finished", loss_cause(e))
                logger.info(f"TokenFlow ingress: stream lost after its last token, closed here: {e!r}")
                for x in last:
                    yield x
                return
            if not engine_lost(e):
                if not flowing:
                    raise  # nothing went out: the ingress answers with its own error
                logger.warning(f"TokenFlow ingress: stream failed after its first token: {e!r}")
                yield lost_event(FAILED_MESSAGE, "InternalServerError", 500)
                return
            if flowing:
                following = continue_after(to) if continue_after is not None else None
                outcome = "ended_mid_stream" if following is None else "continued"
            else:
                following = open_stream if resent < resends else None
                outcome = "gave_up" if following is None else "resent"
                resent += following is not None
            cause = loss_cause(e)
            if on_lost is not None:
                on_lost(outcome, cause)
            if cause == "rebalance":  # routine: the engine chose to move it
                logger.info(f"TokenFlow ingress: stream moved off a busy engine ({outcome.replace('_', ' ')})")
            else:
                logger.warning(f"TokenFlow ingress: engine lost ({outcome.replace('_', ' ')}): {e!r}")
            if outcome == "ended_mid_stream":
                yield lost_event(LOST_MID_STREAM)
                return
            if outcome == "gave_up":
                yield unavailable_response(f"{LOST_MESSAGE} before the first token, "
                                           f"{resends} re-sends failed too; retry later")
                return
            open_stream = following
            if abandon is not None:
                await abandon()
            if resend_after_s > 0 and to is None:  # a move names a live engine: no need to wait
                await asyncio.sleep(resend_after_s)


async def bounce_if_engine_dead(gen: AsyncIterator, dead: Callable[[], bool],
                                stopping: Callable[[], bool] = lambda: False) -> AsyncIterator:
    """A replica's response stream, where a failure caused by its dead
    EngineCore raises EngineLost, as a lost replica does on the ingress's
    side: before the first token the ingress re-sends the request, after it
    continues the stream elsewhere or ends it with the lost-engine event.
    vLLM ends a stream whose engine died with its own error event, and
    raises for a whole request. A batch that holds tokens and that event is
    dropped whole: the ingress never relayed its tokens, so a continuation
    generates them again.

    Once Serve begins to stop the replica (`stopping()`: a new config
    version, or fewer replicas), the stream is handed over the same way:
    after the chunk in hand its engine request is closed (aborted there) and
    EngineLost raised, so the ingress continues it on another engine instead
    of Serve holding the shutdown open until `graceful_shutdown_timeout_s`
    cuts it. A stream its engine holds paused sends no chunk, so it is
    handed over when it runs again (the policy resumes it before its reader
    runs dry). A stream whose answer is over (its finish reason went out)
    is left to end: only its closing chunks are still to come, at once.
    One wrapper for both: it runs on every chunk."""
    try:
        async for item in gen:
            if dead() and is_error_event(item):  # dead() first: a cheap read on every chunk
                raise EngineLost(CORE_DIED)
            yield item
            if stopping() and not answer_over(item):  # a cheap read first
                await gen.aclose()
                raise EngineLost(STOPPING)
    except EngineLost:
        raise
    except Exception as e:
        if not dead():
            raise
        raise EngineLost(f"{CORE_DIED}: {e!r}") from None
