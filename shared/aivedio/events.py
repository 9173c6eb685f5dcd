"""Events carried from the outbox to their consumers. The envelope is what a consumer receives,
locally in-process and in AWS as the SQS message body; `version` lets a consumer tell payload
shapes apart when an event type evolves."""
from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field


class EventEnvelope(BaseModel):
    # extra="ignore": an older consumer must still read an envelope that gained fields.
    model_config = ConfigDict(frozen=True, extra="ignore")

    event_id: UUID
    event_type: str = Field(min_length=1)
    version: int = Field(default=1, ge=1)
    tenant_id: UUID | None = None
    aggregate_type: str
    aggregate_id: UUID | None = None
    payload: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime

    def to_message(self) -> dict[str, Any]:
        """The JSON-ready dict handed to deliver() and consumers."""
        return self.model_dump(mode="json")
