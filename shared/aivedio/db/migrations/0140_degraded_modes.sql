-- 0140: degraded modes (ch. 18.18, ch. 20.12; aivedio.degraded).
--
-- degraded_mode: a mode that one process finds and every process must see, kept until the repair
-- that ends it commits. Today one writer: the capacity-counters service, between finding a shard
-- counter that disagrees with its ACTIVE reservations and committing the repair; the scheduler
-- ticks conservatively meanwhile, and /healthz lists it. Modes a process can see for itself
-- (PostgreSQL or Redis unreachable, an outbox backlog, an open breaker) are not stored.
CREATE TABLE degraded_mode (
    mode       text PRIMARY KEY,
    reason     text NOT NULL,
    detail     jsonb NOT NULL DEFAULT '{}',
    since      timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- The oldest PENDING outbox event, read by admission (cached a second per process) and /healthz:
-- past Limits.outbox_backlog_max_age_seconds admission refuses new work. Partial, so it holds the
-- backlog only, not the published history.
CREATE INDEX idx_outbox_pending_created ON outbox_event (created_at) WHERE status = 'PENDING';
