-- 0120: ways out of MANUAL_REVIEW, parked webhooks and orphan provider jobs (aivedio.attempts.review,
-- reconcile/stuck_submits.py, reconcile/parked_webhooks.py, reconcile/orphan_jobs.py).

-- An attempt in review is still looked up by its key, at a lower rate: when it was last asked, and
-- how often. recoveries_base is the restart count when an operator (or the stuck-submits service)
-- adopted a job for it: the lease scanner's restart budget counts from there, so an adopted
-- attempt that had used its restarts is not sent straight back to review.
ALTER TABLE task_attempt
    ADD COLUMN review_checked_at timestamptz,
    ADD COLUMN review_checks     integer NOT NULL DEFAULT 0 CHECK (review_checks >= 0),
    ADD COLUMN recoveries_base   integer NOT NULL DEFAULT 0 CHECK (recoveries_base >= 0);
CREATE INDEX idx_task_attempt_review_due ON task_attempt (review_checked_at NULLS FIRST)
    WHERE state = 'MANUAL_REVIEW';

-- An orphan is resolved (never deleted): what the provider last said of the job, when it was
-- last asked, and how it ended (COST_RECORDED, COST_PARKED, NO_COST, IN_USE, NOT_FOUND, UNATTRIBUTED;
-- for one kept by its key: JOB_FOUND, KEY_EXPIRED).
-- A job that may exist though nobody learnt its id (a task failed out of review while the provider
-- could not be asked) is kept by its attempt's idempotency key: provider_request_key is set and
-- provider_job_id is the placeholder 'key:' || provider_request_key, until a lookup by key finds it.
ALTER TABLE orphan_provider_job
    ADD COLUMN checked_at  timestamptz,
    ADD COLUMN checks      integer NOT NULL DEFAULT 0 CHECK (checks >= 0),
    ADD COLUMN last_status text,
    ADD COLUMN resolved_at timestamptz,
    ADD COLUMN resolution  text,
    ADD COLUMN provider_request_key text,
    ADD CONSTRAINT orphan_provider_job_resolved_together CHECK ((resolved_at IS NULL) = (resolution IS NULL)),
    ADD CONSTRAINT orphan_provider_job_key_placeholder
        CHECK (provider_request_key IS NULL OR provider_job_id = 'key:' || provider_request_key);
CREATE INDEX idx_orphan_provider_job_open ON orphan_provider_job (checked_at NULLS FIRST) WHERE resolved_at IS NULL;

-- A verified webhook for a job no attempt knows yet (it overtook the submit's answer, or its attempt
-- is in review with its job unknown): kept whole, answered 202, and applied by the parked-webhooks
-- service once the job is mapped. One row per webhook-id, so a repeated delivery is one row.
CREATE TABLE parked_webhook (
    provider        text NOT NULL,
    webhook_id      text NOT NULL,
    provider_job_id text NOT NULL,
    event_type      text NOT NULL,
    body            jsonb NOT NULL,  -- the verified document: {"type", "data": job}
    received_at     timestamptz NOT NULL,
    state           text NOT NULL DEFAULT 'PARKED'
        CONSTRAINT parked_webhook_state_check CHECK (state IN ('PARKED', 'APPLIED', 'DUPLICATE', 'STALE')),
    tries           integer NOT NULL DEFAULT 0 CHECK (tries >= 0),
    last_tried_at   timestamptz,
    last_error      text,
    done_at         timestamptz,
    task_state      text,  -- the task's state once applied
    PRIMARY KEY (provider, webhook_id),
    CONSTRAINT parked_webhook_done_together CHECK ((state = 'PARKED') = (done_at IS NULL))
);
CREATE INDEX idx_parked_webhook_job ON parked_webhook (provider, provider_job_id) WHERE state = 'PARKED';
CREATE INDEX idx_parked_webhook_due ON parked_webhook (last_tried_at NULLS FIRST) WHERE state = 'PARKED';
