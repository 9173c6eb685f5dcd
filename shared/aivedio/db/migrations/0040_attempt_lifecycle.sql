-- 0040: the attempt lifecycle (ch. 18.8, 18.14 to 18.16): when a provider cancel was sent, how
-- often an attempt's workflow was restarted after its lease expired, and the index the lease
-- scanner reads.
ALTER TABLE task_attempt
    ADD COLUMN cancel_sent_at timestamptz,
    ADD COLUMN recoveries     integer NOT NULL DEFAULT 0 CHECK (recoveries >= 0),
    ADD COLUMN final_reason   text;

-- Live attempts only: a finished attempt is never looked at by the lease scanner again.
CREATE INDEX idx_task_attempt_live_lease ON task_attempt (lease_until)
    WHERE state IN ('DISPATCHING', 'SUBMITTED', 'RUNNING', 'SUBMIT_UNKNOWN');
