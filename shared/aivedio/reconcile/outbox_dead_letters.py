"""Room service `outbox-dead-letters`: counts the outbox events that failed Limits.outbox_max_attempts
deliveries (status FAILED), publishes the count as the OutboxDeadLetters gauge on every run, 0
included (the CDK app alarms on it above zero, and when no datapoint came for two runs: the service
stopped), and logs an ALERT line, with the count per event type, while there are any.

It never redrives them itself: an event that fails every delivery (a poison message, a queue that
is not configured for its type) would go round the relay for ever. A person looks at last_error and
redrives with `aivedio admin outbox redrive` (aivedio.outbox.redrive), which is audited. Meanwhile
a terminal event among them does not leave its task unsettled: `unsettled-terminals` settles the
task from the same payload.

One statement per run (a count over the FAILED rows, which idx_outbox_status_next_retry serves), so
there is one batch and nothing to carry over."""
from __future__ import annotations

from aivedio import outbox
from aivedio.metrics_catalog import OUTBOX_DEAD_LETTERS
from aivedio.observability import logger, publish
from aivedio.reconcile.room import Defaults, Report, tuning

NAME = "outbox-dead-letters"
DEFAULTS = Defaults(interval_seconds=300.0, batch_size=1, max_batches=1)


def run_once(platform) -> Report:
    tuning(platform, NAME)  # an unknown key under [maintenance.outbox-dead-letters] fails like everywhere else
    with platform.db.connection() as conn:
        by_type = outbox.dead_letters_by_type(conn)
    total = sum(int(r["n"]) for r in by_type)
    publish(OUTBOX_DEAD_LETTERS, total)
    details = {"dead_letters": total, "by_event_type": {r["event_type"]: int(r["n"]) for r in by_type},
               "oldest": min((r["oldest"] for r in by_type), default=None)}
    if total:
        logger.error("ALERT outbox dead letters: events that failed every delivery wait for an operator",
                     extra={**details, "oldest": details["oldest"].isoformat(),
                            "redrive": "aivedio admin outbox list --status FAILED; aivedio admin outbox redrive "
                                       "--event-id ID --reason R"})
        details["oldest"] = details["oldest"].isoformat()
    return Report(NAME, examined=total, repaired=0, batches=1, complete=True, details=details)
