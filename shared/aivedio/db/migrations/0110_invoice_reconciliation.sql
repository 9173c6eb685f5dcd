-- 0110: daily provider-invoice reconciliation (ch. 20.5.7, 20.10; aivedio.spend.invoices): the documents
-- fetched and archived, each line's match, items that a rerun carries instead of copying, a cursor per
-- provider, and month closes.

-- A charged attempt whose line has not come yet, inside its grace period, is an item of its own.
ALTER TABLE reconciliation_item DROP CONSTRAINT reconciliation_item_discrepancy_type_check;
ALTER TABLE reconciliation_item ADD CONSTRAINT reconciliation_item_discrepancy_type_check
    CHECK (discrepancy_type IN ('MISSING_INTERNAL', 'MISSING_EXTERNAL', 'AMOUNT_MISMATCH',
                                'DUPLICATE_EXTERNAL', 'CURRENCY_MISMATCH', 'TASK_STATUS_MISMATCH',
                                'UNMAPPED_PROVIDER_TASK', 'LATE_CHARGE',
                                'PROVIDER_CREDIT_NOT_APPLIED', 'PENDING_WITHIN_GRACE'));

ALTER TABLE reconciliation_item
    ADD COLUMN provider                 text,
    -- what the item is about, "<type>:line:<line id>" or "<type>:attempt:<attempt id>": a rerun that finds the
    -- same discrepancy finds this row (carried, not copied), whatever its status
    ADD COLUMN item_key                 text,
    ADD COLUMN provider_job_id          text,
    ADD COLUMN billing_date             date,  -- the UTC day of the line or of the cost it is about
    -- the accounting month it is booked in: its own, or the next open one when its own was closed
    ADD COLUMN period_month             date,
    ADD COLUMN resolved_run_id          uuid REFERENCES reconciliation_run (run_id) DEFERRABLE INITIALLY DEFERRED,
    ADD COLUMN resolved_period_month    date,
    -- the appended cost event of an automatic fix (ch. 20.10.5)
    ADD COLUMN resolution_cost_event_id uuid REFERENCES provider_cost_event (cost_event_id) DEFERRABLE INITIALLY DEFERRED,
    ADD CONSTRAINT reconciliation_item_status_check CHECK (status IN ('OPEN', 'RESOLVED')),
    ADD CONSTRAINT reconciliation_item_resolved CHECK (status = 'OPEN' OR resolved_at IS NOT NULL);
CREATE UNIQUE INDEX uq_reconciliation_item_key ON reconciliation_item (provider, item_key) WHERE item_key IS NOT NULL;
CREATE INDEX idx_reconciliation_item_open ON reconciliation_item (provider, billing_date) WHERE status = 'OPEN';
CREATE INDEX idx_reconciliation_item_line ON reconciliation_item (provider, external_line_id) WHERE external_line_id IS NOT NULL;
-- a day's report lists the items its run resolved
CREATE INDEX idx_reconciliation_item_resolved_run ON reconciliation_item (resolved_run_id) WHERE resolved_run_id IS NOT NULL;

-- One run per provider, day and source (the manifest of the documents it read): a rerun on the same source
-- reuses its row. The run's report (its figures and why it is INCOMPLETE) is kept with it.
ALTER TABLE reconciliation_run
    ADD COLUMN incomplete_reasons jsonb NOT NULL DEFAULT '[]',
    ADD COLUMN summary            jsonb NOT NULL DEFAULT '{}',
    ADD COLUMN report_key         text,
    ADD COLUMN report_sha256      text,
    ADD CONSTRAINT reconciliation_run_status_check CHECK (status IN ('RUNNING', 'COMPLETE', 'INCOMPLETE'));
CREATE INDEX idx_reconciliation_run_day ON reconciliation_run (provider, lower(billing_period), started_at DESC);

-- ch. 20.10.3 step 2: every document fetched, by its SHA-256, where it is archived, and when it was read.
CREATE TABLE provider_invoice_document (
    provider         text   NOT NULL,
    account_id       text   NOT NULL,
    invoice_date     date   NOT NULL,
    sha256           text   NOT NULL,
    object_key       text   NOT NULL,
    byte_size        bigint NOT NULL,
    status           text   NOT NULL CONSTRAINT provider_invoice_document_status_check CHECK (status IN ('OK', 'MALFORMED')),
    line_count       integer,  -- lines listed, repeats included; NULL when malformed
    detail           text,
    first_fetched_at timestamptz NOT NULL DEFAULT now(),
    last_fetched_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (provider, account_id, invoice_date, sha256)
);

-- Each line: the invoice day that listed it first, the line as sent (a repeat with another digest is not the
-- same line), and the attempt it was matched to, by which key.
ALTER TABLE provider_invoice_line
    ADD COLUMN billed_date   date,
    ADD COLUMN source_sha256 text,
    ADD COLUMN line_sha256   text,
    ADD COLUMN raw           jsonb,
    ADD COLUMN attempt_id    uuid REFERENCES task_attempt (attempt_id) DEFERRABLE INITIALLY DEFERRED,
    ADD COLUMN match_method  text CONSTRAINT provider_invoice_line_match_method_check
        CHECK (match_method IN ('CHARGE_ID', 'PROVIDER_JOB_ID', 'IDEMPOTENCY_KEY')),
    ADD COLUMN matched_at    timestamptz;
CREATE INDEX idx_provider_invoice_line_attempt ON provider_invoice_line (attempt_id) WHERE attempt_id IS NOT NULL;
CREATE INDEX idx_provider_invoice_line_billed ON provider_invoice_line (provider, billed_date);

-- Per provider: every day up to complete_through has a COMPLETE run; the next run re-pulls from there.
CREATE TABLE provider_invoice_cursor (
    provider         text PRIMARY KEY,
    complete_through date NOT NULL,
    run_id           uuid REFERENCES reconciliation_run (run_id) DEFERRABLE INITIALLY DEFERRED,
    updated_at       timestamptz NOT NULL DEFAULT now()
);

-- A closed month is frozen: its summary never changes, and what is found or corrected later is booked in
-- the next open month. Append-only: a close is not undone.
CREATE TABLE provider_invoice_period (
    provider      text NOT NULL,
    period_month  date NOT NULL CONSTRAINT provider_invoice_period_first_day CHECK (extract(day FROM period_month) = 1),
    closed_at     timestamptz NOT NULL,
    closed_by     text NOT NULL,
    summary       jsonb NOT NULL,
    report_key    text,
    report_sha256 text,
    PRIMARY KEY (provider, period_month)
);
CREATE TRIGGER provider_invoice_period_append_only BEFORE UPDATE OR DELETE ON provider_invoice_period
    FOR EACH ROW EXECUTE FUNCTION aivedio_forbid_mutation();
