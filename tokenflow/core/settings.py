"""The base of every config block: a pydantic model that describes itself.

Each block (the app's args, and within them `tokenflow`, `router`,
`kv_pool`, `admission`) is one class whose fields carry their type, bounds,
default and description once; the JSON schema of the whole app config
(docs/config-schema.json, `tokenflow config-schema`) is generated from them.
Unknown keys are an error, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1)]
Count = Annotated[int, Field(ge=1)]
Amount = Annotated[int, Field(ge=0)]


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    block: ClassVar[str] = "settings"  # the block's name in messages

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool(cls, value: Any, info) -> Any:
        # pydantic reads true/false as 1/0 for numbers; in a config that is a typo.
        if isinstance(value, bool) and cls.model_fields[info.field_name].annotation is not bool:
            raise ValueError("must be a number, not true/false")
        return value

    @classmethod
    def from_dict(cls, d: dict | None):
        """Validate a block; ValueError with a message naming the key."""
        if d is not None and not isinstance(d, dict):
            raise ValueError(f"{cls.block} must be a mapping of settings, got {type(d).__name__}")
        try:
            return cls.model_validate(d or {})
        except ValidationError as e:
            raise ValueError(explain(cls, e)) from None

    def to_dict(self) -> dict:
        return self.model_dump()

    def fingerprint(self) -> str:
        """A digest of these settings. The actors an app's engines share (a
        node's KV pool, the state boards, the node relays) are named with
        it, so a redeploy with other settings gets actors of its own instead
        of finding those of the old settings."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:10]


def explain(cls: type[Settings], e: ValidationError) -> str:
    """One line per problem, with the block's own key names."""
    unknown = [".".join(map(str, err["loc"])) for err in e.errors() if err["type"] == "extra_forbidden"]
    lines = []
    if unknown:
        lines.append(f"unknown {cls.block} keys: {sorted(unknown)}; known: {sorted(cls.model_fields)}")
    for err in e.errors():
        if err["type"] != "extra_forbidden":
            where = ".".join(map(str, (cls.block, *err["loc"])))
            lines.append(f"{where}: {err['msg']}, got {err.get('input')!r}")
    return "; ".join(lines)
