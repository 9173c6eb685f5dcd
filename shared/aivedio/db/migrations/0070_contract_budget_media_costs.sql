-- 0070: the contract budget of an enterprise POSTPAID wallet (ch. 20.1.2: "检查信用额度、合同预算和
-- 账期内累计应收"), and parking for media cost lines that cannot be attributed (ch. 20.9.5).

-- One row per wallet and billing period [period_start, period_end); periods of a wallet never
-- overlap (checked by the one writer, aivedio.billing.contract_budgets, under the wallet lock).
-- settled_amount and refunded_amount are the receivable accrued in the period: credits SETTLED
-- and REFUNDED at a time inside it, moved in the same transaction as those postings. A reservation
-- must keep settled - refunded + the wallet's reserved + its amount <= budget_amount.
CREATE TABLE contract_budget (
    wallet_id       uuid        NOT NULL,
    tenant_id       uuid        NOT NULL,
    period_start    timestamptz NOT NULL,
    period_end      timestamptz NOT NULL,
    budget_amount   bigint      NOT NULL CONSTRAINT contract_budget_amount_nonneg CHECK (budget_amount >= 0),
    settled_amount  bigint      NOT NULL DEFAULT 0 CONSTRAINT contract_budget_settled_nonneg CHECK (settled_amount >= 0),
    refunded_amount bigint      NOT NULL DEFAULT 0 CONSTRAINT contract_budget_refunded_nonneg CHECK (refunded_amount >= 0),
    version         bigint      NOT NULL DEFAULT 0,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (wallet_id, period_start),
    CONSTRAINT contract_budget_period CHECK (period_end > period_start),
    CONSTRAINT contract_budget_wallet_fk FOREIGN KEY (tenant_id, wallet_id)
        REFERENCES wallet_account (tenant_id, wallet_id) DEFERRABLE INITIALLY DEFERRED
);

ALTER TABLE billing_parked_event DROP CONSTRAINT billing_parked_event_reason_check;
ALTER TABLE billing_parked_event ADD CONSTRAINT billing_parked_event_reason_check
    CHECK (reason IN ('UNKNOWN_TASK', 'TENANT_MISMATCH', 'MISSING_CHARGE', 'MALFORMED_EVENT', 'UNKNOWN_OUTCOME',
                      'CURRENCY_MISMATCH', 'CONFLICTING_TERMINAL', 'COST_WITHOUT_CHARGE_ID', 'COST_UNKNOWN',
                      'UNMAPPED_ATTEMPT', 'COST_MISMATCH', 'MEDIA_COST_UNATTRIBUTED'));
