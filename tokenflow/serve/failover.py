"""What the ingress does when an engine replica dies under a request.

A request that has not delivered a token yet is re-sent (Serve's router has
already dropped the dead replica, so the next attempt goes elsewhere); the
client sees at most a later first token. A stream that has delivered tokens
cannot be replayed without repeating them, so it ends with an explicit SSE
error event (then `[DONE]`), never a silent hang or a cut connection.

Chunks with no token (a chat stream's opening role chunk) are held back
until the first token arrives, so a re-send never shows the client a second
opening.
"""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator, Callable

from ray import exceptions as ray_exceptions

from tokenflow.serve.sse import count_chunk

logger = logging.getLogger("ray.serve")

# How a dead or unreachable replica shows up on a Serve handle's stream.
# ActorDiedError is a RayActorError.
REPLICA_LOST = (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError)

LOST_MESSAGE = "the engine serving this request failed"


def carries_token(item) -> bool:
    # Whole responses and error objects are the answer itself.
    if not isinstance(item, (str, bytes, list, tuple)):
        return True
    return count_chunk(item)[0] > 0


def lost_event(message: str) -> str:
    """The SSE event a stream ends with when its engine dies mid-stream
    (the shape OpenAI clients raise as an APIError)."""
    err = {"error": {"message": message, "type": "ServiceUnavailableError", "code": 503}}
    return f"data: {json.dumps(err)}\n\n"


def unavailable_response(message: str):
    """An ErrorResponse the ingress turns into an HTTP 503 JSON body."""
    from ray.serve.llm.openai_api_models import ErrorResponse

    from tokenflow.serve.ray_private import ErrorInfo

    return ErrorResponse(error=ErrorInfo(message=message, type="ServiceUnavailableError", code=503))


# What became of a request whose replica was lost (counted by the ingress).
OUTCOMES = ("resent", "ended_mid_stream", "gave_up")


async def resend_until_first_token(open_stream: Callable[[], AsyncIterator], resends: int,
                                   on_lost: Callable[[str], None] | None = None) -> AsyncIterator:
    """Yield the items of open_stream(); re-open it (at most `resends` times)
    when the replica is lost before any token went out. on_lost hears each
    loss as one of OUTCOMES."""
    for attempt in range(resends + 1):
        held: list = []
        flowing = False
        try:
            async for item in open_stream():
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
        except REPLICA_LOST as e:
            outcome = "ended_mid_stream" if flowing else "gave_up" if attempt == resends else "resent"
            if on_lost is not None:
                on_lost(outcome)
            logger.warning(f"TokenFlow ingress: engine lost ({outcome.replace('_', ' ')}; "
                           f"attempt {attempt + 1} of {resends + 1}): {e!r}")
            if outcome == "ended_mid_stream":
                yield lost_event(f"{LOST_MESSAGE} mid-stream; the response is incomplete")
                return
            if outcome == "gave_up":
                yield unavailable_response(f"{LOST_MESSAGE} before the first token, "
                                           f"{resends} re-sends failed too; retry later")
                return
