"""What a tenant is told about a task that failed, was cancelled or waits for review: a code and a
short message from the one table below, never the text a provider (or an operator alert) wrote.

The platform keeps the detail where operators read it: the provider's own error (its code, its
message, the whole answer) on the attempt (task_attempt.raw_last_response, task_attempt.error_code),
and the internal reason on the task (generation_task.error_code / error_message). Only the view
(aivedio.views) translates, through `tenant_error`."""
from __future__ import annotations

# internal error code (exact, or a prefix ending in "_") -> (tenant code, message). The first match
# wins, so the specific entries come before the prefixes that would also match them.
TENANT_ERRORS: tuple[tuple[str, str, str], ...] = (
    ("PROVIDER_REJECTED_", "PROVIDER_REJECTED", "the video provider refused this request"),
    ("PROVIDER_CONTENT_FILTERED", "CONTENT_FILTERED", "the result was blocked by the provider's safety filter"),
    ("PROVIDER_TIMEOUT", "TIMED_OUT", "the generation took too long and was stopped"),
    ("PROVIDER_TIMED_OUT", "TIMED_OUT", "the generation took too long and was stopped"),
    ("DEADLINE_EXCEEDED", "TIMED_OUT", "the generation took too long and was stopped"),
    ("PROVIDER_", "PROVIDER_FAILED", "the video provider could not complete the generation"),
    ("MEDIA_", "MEDIA_PROCESSING_FAILED", "the generated video could not be processed"),
)

# What a state says when its internal code is missing or matches no entry; CANCELLED and MANUAL_REVIEW
# always say this, whatever their reason (only a tenant's cancel ends a task CANCELLED, and a task in
# review is in review whichever alert sent it there).
FIXED = frozenset({"CANCELLED", "MANUAL_REVIEW"})
BY_STATE: dict[str, tuple[str, str]] = {
    "FAILED": ("GENERATION_FAILED", "the generation failed"),
    "CANCELLED": ("CANCELLED_BY_USER", "the task was cancelled at your request"),
    "MANUAL_REVIEW": ("UNDER_REVIEW", "the task's state at the provider is being checked by an operator"),
    "MEDIA_INGEST_FAILED": ("MEDIA_PROCESSING_FAILED", "the generated video could not be processed"),
}


def tenant_error(state: str, error_code: str | None) -> dict[str, str] | None:
    """The `error` of a task's tenant view, or None for a state that has none to show."""
    if state not in BY_STATE:
        return None
    if state in FIXED:
        return _doc(BY_STATE[state])
    for match, code, message in TENANT_ERRORS:
        if error_code and (error_code == match or (match.endswith("_") and error_code.startswith(match))):
            return {"code": code, "message": message}
    return _doc(BY_STATE[state])


def _doc(pair: tuple[str, str]) -> dict[str, str]:
    return {"code": pair[0], "message": pair[1]}
