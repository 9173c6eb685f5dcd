"""The attempt lease scanner (ch. 18.16.6). Every running workflow renews its attempt's lease at
each step; an attempt whose lease expired lost its execution (a crashed process, a failed
execution). The scanner takes the lease over by CAS and starts a new execution, whose first step
reads PostgreSQL and resumes: a submit that may have been sent is looked up by its key, never
resent, and nothing is released before the provider has been asked."""
from __future__ import annotations

from aivedio.attempts import executions
from aivedio.attempts.lifecycle import AttemptRef
from aivedio.attempts.steps import to_manual_review
from aivedio.faults import safeguards
from aivedio.metrics_catalog import ATTEMPTS_RECOVERED
from aivedio.observability import logger, publish
from aivedio.tasks import ATTEMPT_LIVE

BATCH = 200

# The takeover, by CAS. The state guard: only a live attempt whose lease expired ({expired}) is
# taken, checked again on the locked row, so one whose workflow renewed its lease is left alone.
TAKE_OVER = """update task_attempt a set lease_until = %(until)s, recoveries = a.recoveries + 1, updated_at = %(now)s
                 from generation_task t
                where a.attempt_id in (
                      select attempt_id from task_attempt
                       where state = any(%(live)s){expired}
                       order by lease_until limit %(limit)s for update skip locked)
                  and t.tenant_id = a.tenant_id and t.task_id = a.task_id
                  and t.current_attempt_id = a.attempt_id and t.current_fencing_token = a.fencing_token
                returning a.tenant_id, a.task_id, a.attempt_id, a.fencing_token, a.recoveries, a.recoveries_base, a.state"""
EXPIRED = " and lease_until < %(now)s"


def restart_expired(platform, limit: int = BATCH) -> int:
    if safeguards.broken("lease-scanner"):
        return 0  # chaos only: a lost execution is never resumed
    now = platform.clock.now()
    lease = platform.clock.delta(platform.config.timers.lease_seconds)
    # Chaos only (rescuer-state-guard): without the expiry guard a live, leased attempt is restarted too.
    take_over = TAKE_OVER.format(expired="" if safeguards.broken("rescuer-state-guard") else EXPIRED)

    def tx(conn) -> list[dict]:
        return conn.execute(take_over, {"until": now + lease, "now": now, "live": list(ATTEMPT_LIVE), "limit": limit}).fetchall()

    rows = platform.db.transaction(tx)
    for r in rows:
        ref = AttemptRef(r["tenant_id"], r["task_id"], r["attempt_id"], r["fencing_token"])
        # The budget counts from the last adoption out of review (aivedio.attempts.review), whose
        # decision gives the attempt a fresh one; the execution names keep counting from `recoveries`.
        spent = r["recoveries"] - r["recoveries_base"]
        if spent > platform.config.limits.max_attempt_recoveries:
            # Its steps fail every time (a provider removed from the config, a bug): restarting it
            # again would hold its reservations forever. A person decides; the job may be live.
            to_manual_review(platform, ref, "RECOVERY_EXHAUSTED",
                             f"the workflow was restarted {spent - 1} times without finishing")
            continue
        name = executions.start(platform, ref, recoveries=r["recoveries"])
        publish(ATTEMPTS_RECOVERED, state=r["state"])
        logger.warning("attempt lease expired; workflow restarted", extra={**ref.log(), "state": r["state"], "execution": name})
    return len(rows)
