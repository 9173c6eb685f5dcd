-- 0030: the money lifecycle after admission (ch. 20.5 to 20.9, 20.13.7): the settlement outcome
-- on the charge snapshot, what expired of a credit lot, refund request keys, compensation
-- approvals, settlement events parked for reconciliation, operator roles (RBAC), subscription
-- grants, wallet-check findings, budget alert levels and media cost facts.

-- ch. 20.6.4 step 7: the charge snapshot records its settlement. finalized_at is the guard a
-- redelivered terminal event finds; settled_outcome tells a duplicate from a conflicting event.
ALTER TABLE generation_charge
    ADD COLUMN settle_ledger_txn_id uuid REFERENCES ledger_transaction (ledger_txn_id) DEFERRABLE INITIALLY DEFERRED,
    ADD COLUMN settled_outcome      text,
    ADD COLUMN settle_reason        text,
    -- what the locked policy would have charged beyond its cap (ch. 20.6.5): the platform bears it
    ADD COLUMN absorbed_amount      bigint NOT NULL DEFAULT 0 CHECK (absorbed_amount >= 0),
    ADD COLUMN delivered_seconds    integer CHECK (delivered_seconds >= 0),
    -- the attempt whose outcome was settled; the cost report tells duplicates from it
    ADD COLUMN settled_attempt_id   uuid,
    ADD CONSTRAINT generation_charge_finalized_has_outcome
        CHECK (finalized_at IS NULL OR (final_charge_amount IS NOT NULL AND settled_outcome IS NOT NULL));
CREATE INDEX idx_generation_charge_finalized ON generation_charge (finalized_at) WHERE finalized_at IS NOT NULL;

-- An expired lot keeps its history: remaining moves to expired_amount (EXPIRE entries, ch. 20.5.8).
ALTER TABLE credit_lot
    ADD COLUMN expired_amount bigint NOT NULL DEFAULT 0 CONSTRAINT credit_lot_expired_nonneg CHECK (expired_amount >= 0);
CREATE INDEX idx_credit_lot_expiring ON credit_lot (expires_at)
    WHERE remaining_amount > 0 AND expires_at IS NOT NULL;

-- A refund request is idempotent on the caller's key; a rejected one says why.
ALTER TABLE refund_request
    ADD COLUMN request_key     text,
    -- arrival order: pending refunds are applied in it when their task settles
    ADD COLUMN request_seq     bigserial,
    ADD COLUMN rejected_reason text,
    ADD CONSTRAINT refund_request_tenant_request_key UNIQUE (tenant_id, request_key);

-- Above the configured threshold a compensation needs two distinct approvers (ch. 20.6.7).
ALTER TABLE compensation_case
    ADD COLUMN required_approvals smallint NOT NULL DEFAULT 1
        CONSTRAINT compensation_case_required_approvals CHECK (required_approvals BETWEEN 1 AND 2),
    ADD COLUMN lot_expires_at timestamptz,
    ADD COLUMN task_id        uuid,
    ADD CONSTRAINT compensation_case_case_id_nonempty CHECK (char_length(btrim(case_id)) > 0),
    ADD CONSTRAINT compensation_case_reason_nonempty CHECK (char_length(btrim(reason_code)) > 0);

-- Settlement input that cannot be applied as it stands: kept for reconciliation, never dropped.
-- No FK on task_id: an unknown task is one of the reasons.
CREATE TABLE billing_parked_event (
    parked_id   uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    dedupe_key  text NOT NULL CONSTRAINT billing_parked_event_dedupe_key UNIQUE,
    reason      text NOT NULL
        CONSTRAINT billing_parked_event_reason_check
        CHECK (reason IN ('UNKNOWN_TASK', 'TENANT_MISMATCH', 'MISSING_CHARGE', 'MALFORMED_EVENT', 'UNKNOWN_OUTCOME',
                          'CURRENCY_MISMATCH', 'CONFLICTING_TERMINAL', 'COST_WITHOUT_CHARGE_ID', 'COST_UNKNOWN',
                          'UNMAPPED_ATTEMPT', 'COST_MISMATCH')),
    event_type  text,
    event_id    uuid,
    task_id     uuid,
    tenant_id   uuid,
    attempt_id  uuid,
    payload     jsonb NOT NULL DEFAULT '{}',
    detail      text,
    status      text NOT NULL DEFAULT 'OPEN'
        CONSTRAINT billing_parked_event_status_check CHECK (status IN ('OPEN', 'RESOLVED')),
    resolution  text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    resolved_at timestamptz,
    CONSTRAINT billing_parked_event_resolved CHECK (status = 'OPEN' OR resolved_at IS NOT NULL)
);
CREATE INDEX idx_billing_parked_event_open ON billing_parked_event (reason, created_at) WHERE status = 'OPEN';
CREATE INDEX idx_billing_parked_event_task ON billing_parked_event (task_id) WHERE task_id IS NOT NULL;

-- Operator roles for the admin commands (aivedio.policy.roles); grants and revocations are audited.
CREATE TABLE operator_role (
    operator   text NOT NULL CONSTRAINT operator_role_operator_nonempty CHECK (char_length(operator) > 0),
    role       text NOT NULL
        CONSTRAINT operator_role_role_check CHECK (role IN ('BILLING_ADMIN', 'SUPPORT', 'FINANCE_APPROVER', 'AUDITOR')),
    granted_by text NOT NULL,
    granted_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (operator, role)
);

-- Subscription wallets get a grant each period (a SUBSCRIPTION lot expiring at the period's end).
CREATE TABLE wallet_subscription (
    wallet_id      uuid PRIMARY KEY,
    tenant_id      uuid   NOT NULL,
    grant_amount   bigint NOT NULL CONSTRAINT wallet_subscription_grant_positive CHECK (grant_amount > 0),
    period_seconds bigint NOT NULL CONSTRAINT wallet_subscription_period_positive CHECK (period_seconds > 0),
    next_grant_at  timestamptz NOT NULL,
    active         boolean NOT NULL DEFAULT true,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT wallet_subscription_wallet_fk FOREIGN KEY (tenant_id, wallet_id)
        REFERENCES wallet_account (tenant_id, wallet_id) DEFERRABLE INITIALLY DEFERRED
);
CREATE INDEX idx_wallet_subscription_due ON wallet_subscription (next_grant_at) WHERE active;

-- ch. 20.8.5: what a wallet check found; resolved by a rebuild that appends adjustments.
CREATE TABLE wallet_discrepancy (
    discrepancy_id           uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    wallet_id                uuid   NOT NULL,
    tenant_id                uuid   NOT NULL,
    kind                     text   NOT NULL,
    expected                 bigint NOT NULL,
    actual                   bigint NOT NULL,
    status                   text   NOT NULL DEFAULT 'OPEN'
        CONSTRAINT wallet_discrepancy_status_check CHECK (status IN ('OPEN', 'RESOLVED')),
    resolution_ledger_txn_id uuid REFERENCES ledger_transaction (ledger_txn_id) DEFERRABLE INITIALLY DEFERRED,
    resolved_by              text,
    found_at                 timestamptz NOT NULL DEFAULT now(),
    resolved_at              timestamptz,
    CONSTRAINT wallet_discrepancy_wallet_fk FOREIGN KEY (tenant_id, wallet_id)
        REFERENCES wallet_account (tenant_id, wallet_id) DEFERRABLE INITIALLY DEFERRED
);
CREATE UNIQUE INDEX uq_wallet_discrepancy_open ON wallet_discrepancy (wallet_id, kind) WHERE status = 'OPEN';

-- ch. 20.9.4: the highest threshold (70, 90, 100) already alerted in the budget's period.
ALTER TABLE budget_account ADD COLUMN alert_level smallint NOT NULL DEFAULT 0;

-- ch. 20.9.1, 20.9.5: media costs aggregated from inventories, CDN logs and render usage,
-- attributed by the object's tags. Append-only; source_key makes a re-import add nothing.
CREATE TABLE media_cost_event (
    media_cost_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    source_key    text NOT NULL CONSTRAINT media_cost_event_source_key UNIQUE,
    tenant_id     uuid REFERENCES tenant (tenant_id),
    task_id       uuid,
    project_id    text,
    kind          text NOT NULL
        CONSTRAINT media_cost_event_kind_check
        CHECK (kind IN ('OUTPUT_FETCH', 'TRANSCODE', 'GPU_RENDER', 'STORAGE', 'EGRESS', 'MODERATION')),
    amount        numeric(20, 8) NOT NULL,
    currency      text NOT NULL,
    occurred_at   timestamptz NOT NULL,
    tags          jsonb NOT NULL DEFAULT '{}',
    created_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idx_media_cost_event_occurred ON media_cost_event (occurred_at);
CREATE TRIGGER media_cost_event_append_only BEFORE UPDATE OR DELETE ON media_cost_event
    FOR EACH ROW EXECUTE FUNCTION aivedio_forbid_mutation();
CREATE TRIGGER media_cost_event_no_truncate BEFORE TRUNCATE ON media_cost_event
    FOR EACH STATEMENT EXECUTE FUNCTION aivedio_forbid_mutation();
