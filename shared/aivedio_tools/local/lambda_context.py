"""The context object Lambda passes to a handler, for running handlers in-process."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from aivedio_tools.local.apigw import ACCOUNT_ID


@dataclass
class FakeLambdaContext:
    function_name: str
    timeout_seconds: float = 29.0  # API Gateway's integration timeout
    memory_limit_in_mb: int = 1024
    function_version: str = "$LATEST"
    aws_request_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    _deadline: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._deadline = time.monotonic() + self.timeout_seconds

    @property
    def invoked_function_arn(self) -> str:
        return f"arn:aws:lambda:local:{ACCOUNT_ID}:function:{self.function_name}"

    @property
    def log_group_name(self) -> str:
        return f"/aws/lambda/{self.function_name}"

    @property
    def log_stream_name(self) -> str:
        return "local"

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))
