"""TokenFlowLLMServer: Ray Serve LLM's LLMServer plus a per-request reading rate.

Clients state how fast they read a stream as `consumption_rate` (tokens/s),
either as a top-level body field or as `vllm_xargs.consumption_rate`. vLLM
only forwards `vllm_xargs` to the engine (as `SamplingParams.extra_args`, which
the TokenFlow scheduler reads), and a top-level unknown field survives the
OpenAI ingress only as the pydantic request's `model_extra`. So this class
validates the rate and writes it into `vllm_xargs` before the engine sees it.
"""

from __future__ import annotations

from typing import Any, AsyncGenerator, Optional

from ray.llm._internal.serve.core.configs.openai_api_models import (
    ErrorInfo,
    ErrorResponse,
)
from ray.serve.llm import LLMServer

from tokenflow.config import TokenFlowConfig, parse_rate

RATE_KEY = "consumption_rate"


def tokenflow_config_of(llm_config) -> TokenFlowConfig:
    """The TokenFlow knobs live in engine_kwargs.additional_config.tokenflow,
    the same dict the scheduler reads inside the EngineCore process, so the
    replica and the scheduler can never disagree (e.g. on default_rate)."""
    additional = llm_config.engine_kwargs.get("additional_config") or {}
    return TokenFlowConfig.from_dict(additional.get("tokenflow"))


def bad_request(message: str, param: Optional[str] = RATE_KEY) -> ErrorResponse:
    # The OpenAI ingress turns an ErrorResponse that is the *first* item a
    # replica yields into an HTTP error whose status is `error.code`; raising
    # an exception here instead would surface as a 500.
    return ErrorResponse(
        error=ErrorInfo(message=message, type="BadRequestError", param=param, code=400)
    )


def apply_consumption_rate(request: Any, cfg: TokenFlowConfig) -> Optional[ErrorResponse]:
    """Validate the stated rate and store it in request.vllm_xargs.

    Returns an ErrorResponse for an invalid rate, None on success."""
    top = (request.model_extra or {}).get(RATE_KEY)
    xargs = dict(request.vllm_xargs or {})
    nested = xargs.get(RATE_KEY)
    if top is not None and nested is not None and top != nested:
        return bad_request(
            f"{RATE_KEY} given twice with different values ({top!r} and vllm_xargs {nested!r})"
        )
    try:
        rate = parse_rate(top if top is not None else nested, cfg)
    except ValueError as e:
        return bad_request(str(e))
    # Always set it (the default too) so the scheduler sees one explicit value.
    xargs[RATE_KEY] = rate
    request.vllm_xargs = xargs
    return None


async def _yield_once(item: Any) -> AsyncGenerator[Any, None]:
    yield item


class TokenFlowLLMServer(LLMServer):
    """LLMServer that maps `consumption_rate` into `vllm_xargs`; otherwise
    unchanged. Only the chat and completions endpoints generate tokens."""

    async def __init__(self, llm_config, **kwargs):
        # Parse before the (slow) engine start so a bad config fails fast.
        self._tokenflow_cfg = tokenflow_config_of(llm_config)
        await super().__init__(llm_config, **kwargs)

    async def chat(self, request, raw_request_info=None):
        if (error := apply_consumption_rate(request, self._tokenflow_cfg)) is not None:
            return _yield_once(error)
        return await super().chat(request, raw_request_info)

    async def completions(self, request, raw_request_info=None):
        if (error := apply_consumption_rate(request, self._tokenflow_cfg)) is not None:
            return _yield_once(error)
        return await super().completions(request, raw_request_info)
