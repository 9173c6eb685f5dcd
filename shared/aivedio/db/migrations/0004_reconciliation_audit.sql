-- 0004: provider cost facts, invoice reconciliation (ch.20.5.5, 20.5.7),
-- orphan provider jobs and the operator audit log.

-- ch.20.5.5. Append-only: a wrong cost is corrected by a new adjustment event.
-- amount may be negative (credit notes).
CREATE TABLE provider_cost_event (
    cost_event_id       uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    attempt_id          uuid REFERENCES task_attempt (attempt_id) DEFERRABLE INITIALLY DEFERRED,
    tenant_id           uuid REFERENCES tenant (tenant_id),
    task_id             uuid REFERENCES generation_task (task_id) DEFERRABLE INITIALLY DEFERRED,
    provider            text NOT NULL,
    provider_account_id text NOT NULL,
    external_charge_id  text,
    external_line_id    text,
    event_type          text NOT NULL,
    amount              numeric(20, 8) NOT NULL,
    currency            text NOT NULL,
    source              text NOT NULL
        CONSTRAINT provider_cost_event_source_check CHECK (source IN ('CALLBACK', 'POLL', 'API', 'INVOICE')),
    occurred_at         timestamptz NOT NULL,
    raw_payload_hash    text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    -- NULL external_charge_id does not dedupe: such events go to reconciliation (ch.20.5.5)
    CONSTRAINT provider_cost_event_charge_key
        UNIQUE (provider, provider_account_id, external_charge_id, event_type)
);
CREATE UNIQUE INDEX uq_provider_cost_event_line
    ON provider_cost_event (provider, external_line_id) WHERE external_line_id IS NOT NULL;
CREATE INDEX idx_provider_cost_event_occurred ON provider_cost_event (provider, occurred_at);
CREATE INDEX idx_provider_cost_event_attempt ON provider_cost_event (attempt_id) WHERE attempt_id IS NOT NULL;
CREATE INDEX idx_provider_cost_event_task ON provider_cost_event (task_id) WHERE task_id IS NOT NULL;
CREATE TRIGGER provider_cost_event_append_only BEFORE UPDATE OR DELETE ON provider_cost_event
    FOR EACH ROW EXECUTE FUNCTION aivedio_forbid_mutation();
CREATE TRIGGER provider_cost_event_no_truncate BEFORE TRUNCATE ON provider_cost_event
    FOR EACH STATEMENT EXECUTE FUNCTION aivedio_forbid_mutation();

-- ch.20.5.7. Same provider file (checksum) for the same period runs once.
CREATE TABLE reconciliation_run (
    run_id                uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    provider              text NOT NULL,
    billing_period        daterange NOT NULL,
    source_object_key     text NOT NULL,
    source_checksum       text NOT NULL,
    status                text NOT NULL DEFAULT 'RUNNING',
    currency              text NOT NULL DEFAULT 'USD',
    total_external_amount numeric(20, 8) NOT NULL DEFAULT 0,
    total_internal_amount numeric(20, 8) NOT NULL DEFAULT 0,
    started_at            timestamptz NOT NULL DEFAULT now(),
    finished_at           timestamptz,
    CONSTRAINT reconciliation_run_source_key UNIQUE (provider, billing_period, source_checksum)
);

CREATE TABLE reconciliation_item (
    item_id                  uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    run_id                   uuid NOT NULL REFERENCES reconciliation_run (run_id) DEFERRABLE INITIALLY DEFERRED,
    tenant_id                uuid REFERENCES tenant (tenant_id),
    task_id                  uuid REFERENCES generation_task (task_id) DEFERRABLE INITIALLY DEFERRED,
    attempt_id               uuid REFERENCES task_attempt (attempt_id) DEFERRABLE INITIALLY DEFERRED,
    external_line_id         text,
    discrepancy_type         text NOT NULL
        CONSTRAINT reconciliation_item_discrepancy_type_check
        CHECK (discrepancy_type IN ('MISSING_INTERNAL', 'MISSING_EXTERNAL', 'AMOUNT_MISMATCH',
                                    'DUPLICATE_EXTERNAL', 'CURRENCY_MISMATCH', 'TASK_STATUS_MISMATCH',
                                    'UNMAPPED_PROVIDER_TASK', 'LATE_CHARGE',
                                    'PROVIDER_CREDIT_NOT_APPLIED')),
    internal_amount          numeric(20, 8),
    external_amount          numeric(20, 8),
    currency                 text NOT NULL,
    status                   text NOT NULL DEFAULT 'OPEN',
    resolution_code          text,
    resolution_ledger_txn_id uuid REFERENCES ledger_transaction (ledger_txn_id) DEFERRABLE INITIALLY DEFERRED,
    evidence                 jsonb NOT NULL DEFAULT '{}',
    created_at               timestamptz NOT NULL DEFAULT now(),
    resolved_at              timestamptz
);
CREATE INDEX idx_reconciliation_item_run ON reconciliation_item (run_id, status, discrepancy_type);
CREATE INDEX idx_reconciliation_item_attempt ON reconciliation_item (attempt_id) WHERE attempt_id IS NOT NULL;

-- Normalized provider invoice lines (provider-protocol.md "Invoices").
-- Lines arrive late and duplicated: (provider, line_id) stores each once.
CREATE TABLE provider_invoice_line (
    provider        text NOT NULL,
    line_id         text NOT NULL,
    charge_id       text,
    job_id          text,
    idempotency_key text,
    account_id      text NOT NULL,
    model           text,
    type            text NOT NULL
        CONSTRAINT provider_invoice_line_type_check CHECK (type IN ('charge', 'credit_note')),
    amount          numeric(20, 8) NOT NULL,
    currency        text NOT NULL,
    occurred_at     timestamptz NOT NULL,
    run_id          uuid REFERENCES reconciliation_run (run_id) DEFERRABLE INITIALLY DEFERRED,
    first_seen_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT provider_invoice_line_key PRIMARY KEY (provider, line_id)
);
CREATE INDEX idx_provider_invoice_line_charge ON provider_invoice_line (provider, charge_id);
CREATE INDEX idx_provider_invoice_line_job ON provider_invoice_line (provider, job_id);
CREATE INDEX idx_provider_invoice_line_occurred ON provider_invoice_line (provider, occurred_at);

-- Provider jobs the platform has no (current) attempt for: kept, never dropped,
-- because they may still be billed (ch.18.16.3).
CREATE TABLE orphan_provider_job (
    provider         text NOT NULL,
    provider_job_id  text NOT NULL,
    provider_account text,
    attempt_id       uuid REFERENCES task_attempt (attempt_id) DEFERRABLE INITIALLY DEFERRED,
    reason           text NOT NULL DEFAULT 'UNMAPPED',
    payload          jsonb NOT NULL DEFAULT '{}',
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (provider, provider_job_id)
);

-- Operator actions under RBAC (policies, capacities, prices, refunds, ...). Append-only.
-- No FK to tenant: the audit trail must never block or be blocked.
CREATE TABLE audit_log (
    audit_id       bigserial PRIMARY KEY,
    tenant_id      uuid,
    operator       text NOT NULL,
    action         text NOT NULL,
    target         text,
    old_value      jsonb,
    new_value      jsonb,
    reason         text,
    policy_version bigint,
    created_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idx_audit_log_tenant_created ON audit_log (tenant_id, created_at DESC);
CREATE INDEX idx_audit_log_created ON audit_log (created_at);
CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE ON audit_log
    FOR EACH ROW EXECUTE FUNCTION aivedio_forbid_mutation();
CREATE TRIGGER audit_log_no_truncate BEFORE TRUNCATE ON audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION aivedio_forbid_mutation();
