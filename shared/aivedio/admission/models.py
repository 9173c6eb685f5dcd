"""The generation request as clients send it. Client-chosen lane, weight, priority, price or
resource class are not fields here: unknown fields are ignored, and the server derives them."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Mode = Literal["text_to_video", "image_to_video", "video_to_video", "extend"]
Resolution = Literal["480p", "720p", "1080p", "4k"]


class InputRef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    # Printable ASCII only (non-ASCII is percent-encoded): no spaces or control characters, and one
    # meaning for the pattern in every regex dialect (\s differs between JSON Schema and Rust).
    url: str = Field(min_length=8, max_length=2048, pattern=r"^(https?|s3)://[!-~]+$")
    kind: Literal["image", "video", "audio"]


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1, max_length=64)
    mode: Mode
    # Required and not blank: an empty or whitespace-only prompt is refused (422 naming body.prompt).
    # The schema says min_length 1; "not only whitespace" is checked below rather than by a pattern,
    # whose \s means different things in JSON Schema and in pydantic's Rust regex.
    prompt: str = Field(min_length=1, max_length=4000, pattern=r"^[^\x00]*$",  # PostgreSQL text cannot hold NUL
                        description="what to generate; not empty and not only whitespace")
    duration_seconds: int = Field(gt=0, le=600)
    resolution: Resolution
    with_audio: bool = False
    inputs: list[InputRef] = Field(default_factory=list, max_length=8)
    interactive: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt_not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("the prompt is empty or only whitespace")
        return v
