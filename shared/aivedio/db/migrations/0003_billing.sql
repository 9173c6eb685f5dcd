-- 0003: wallets, credit lots, price book, charges, credit reservations, the
-- double-entry append-only ledger (ch.20.5), refunds, compensation, budgets.
-- Credits are bigint minimal units; provider money is numeric(20,8) + currency.

-- ch.20.5.1: snapshot for fast checks and row locks; the ledger is the history.
CREATE TABLE wallet_account (
    wallet_id           uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id           uuid   NOT NULL REFERENCES tenant (tenant_id),
    account_type        text   NOT NULL
        CONSTRAINT wallet_account_type_check CHECK (account_type IN ('PREPAID', 'SUBSCRIPTION', 'POSTPAID')),
    unit_code           text   NOT NULL DEFAULT 'CREDIT',
    available_amount    bigint NOT NULL DEFAULT 0,
    reserved_amount     bigint NOT NULL DEFAULT 0
        CONSTRAINT wallet_account_reserved_nonneg CHECK (reserved_amount >= 0),
    credit_limit_amount bigint NOT NULL DEFAULT 0
        CONSTRAINT wallet_account_credit_limit_nonneg CHECK (credit_limit_amount >= 0),
    consumed_amount     bigint NOT NULL DEFAULT 0
        CONSTRAINT wallet_account_consumed_nonneg CHECK (consumed_amount >= 0),
    version             bigint NOT NULL DEFAULT 0,
    status              text   NOT NULL DEFAULT 'ACTIVE',
    frozen              boolean NOT NULL DEFAULT false,
    freeze_reason       text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT wallet_account_tenant_unit_type_key UNIQUE (tenant_id, unit_code, account_type),
    -- targets of composite FKs (tenant and unit consistency of ledger rows)
    CONSTRAINT wallet_account_tenant_wallet_key UNIQUE (tenant_id, wallet_id),
    CONSTRAINT wallet_account_tenant_wallet_unit_key UNIQUE (tenant_id, wallet_id, unit_code),
    CONSTRAINT wallet_account_prepaid_nonneg
        CHECK (account_type <> 'PREPAID' OR available_amount >= 0),
    CONSTRAINT wallet_account_subscription_nonneg
        CHECK (account_type <> 'SUBSCRIPTION' OR available_amount >= 0),
    CONSTRAINT wallet_account_postpaid_within_credit
        CHECK (account_type <> 'POSTPAID' OR available_amount >= -credit_limit_amount)
);

-- ch.20.5.8. remaining_amount is the lot's spendable part and reserved_amount its
-- reserved part, mirroring wallet available/reserved; consumed credit leaves the lot.
CREATE TABLE credit_lot (
    lot_id              uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    wallet_id           uuid   NOT NULL,
    tenant_id           uuid   NOT NULL,
    kind                text   NOT NULL
        CONSTRAINT credit_lot_kind_check CHECK (kind IN ('PAID', 'SUBSCRIPTION', 'PROMOTIONAL', 'COMPENSATION')),
    original_amount     bigint NOT NULL CONSTRAINT credit_lot_original_positive CHECK (original_amount > 0),
    remaining_amount    bigint NOT NULL
        CONSTRAINT credit_lot_remaining_nonneg CHECK (remaining_amount >= 0),
    reserved_amount     bigint NOT NULL DEFAULT 0
        CONSTRAINT credit_lot_reserved_nonneg CHECK (reserved_amount >= 0),
    priority            integer NOT NULL DEFAULT 0,
    expires_at          timestamptz,
    source_business_key text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT credit_lot_remaining_le_original CHECK (remaining_amount <= original_amount),
    CONSTRAINT credit_lot_reserved_le_original CHECK (reserved_amount <= original_amount),
    CONSTRAINT credit_lot_parts_le_original CHECK (remaining_amount + reserved_amount <= original_amount),
    CONSTRAINT credit_lot_wallet_source_key UNIQUE (wallet_id, source_business_key),
    CONSTRAINT credit_lot_wallet_fk FOREIGN KEY (tenant_id, wallet_id)
        REFERENCES wallet_account (tenant_id, wallet_id) DEFERRABLE INITIALLY DEFERRED
);
-- earliest-expiry-first allocation
CREATE INDEX idx_credit_lot_allocation ON credit_lot (wallet_id, expires_at NULLS LAST, priority);
CREATE TRIGGER credit_lot_fill_tenant BEFORE INSERT ON credit_lot
    FOR EACH ROW EXECUTE FUNCTION aivedio_fill_tenant_id('wallet_account', 'wallet_id', 'wallet_id');

-- ch.20.5.4. A version is immutable once written; a price change is a new row.
CREATE TABLE price_book (
    price_version_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    product_code     text  NOT NULL,
    effective_from   timestamptz NOT NULL,
    effective_to     timestamptz,
    currency_or_unit text  NOT NULL,
    rules            jsonb NOT NULL,
    status           text  NOT NULL DEFAULT 'ACTIVE'
        CONSTRAINT price_book_status_check CHECK (status IN ('ACTIVE', 'RETIRED', 'DRAFT')),
    created_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT price_book_product_effective_key UNIQUE (product_code, effective_from),
    CONSTRAINT price_book_effective_range CHECK (effective_to IS NULL OR effective_to > effective_from)
);

-- Only effective_to and status may change (closing or retiring a version):
-- running tasks settle with the rules they were quoted with (ch.20.7.7).
CREATE FUNCTION price_book_immutable() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF (to_jsonb(NEW) - 'effective_to' - 'status') IS DISTINCT FROM
       (to_jsonb(OLD) - 'effective_to' - 'status') THEN
        RAISE EXCEPTION 'price_book version % is immutable: only effective_to and status may change',
            OLD.price_version_id
            USING ERRCODE = 'P0001', HINT = 'insert a new price version';
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER price_book_immutable BEFORE UPDATE ON price_book
    FOR EACH ROW EXECUTE FUNCTION price_book_immutable();

-- ch.20.5.4: per-task charge snapshot, locked at creation.
CREATE TABLE generation_charge (
    task_id             uuid PRIMARY KEY,
    tenant_id           uuid   NOT NULL,
    price_version_id    uuid   NOT NULL REFERENCES price_book (price_version_id),
    normalized_params   jsonb  NOT NULL,
    quoted_amount       bigint NOT NULL CHECK (quoted_amount >= 0),
    max_reserve_amount  bigint NOT NULL CHECK (max_reserve_amount >= 0),
    final_charge_amount bigint CHECK (final_charge_amount >= 0),
    charge_policy_code  text   NOT NULL,
    charge_version      integer NOT NULL DEFAULT 1 CHECK (charge_version >= 1),
    created_at          timestamptz NOT NULL DEFAULT now(),
    finalized_at        timestamptz,
    -- max_reserve is the quote or an upper bound on it (ch.20.6.1)
    CONSTRAINT generation_charge_max_reserve_ge_quote CHECK (max_reserve_amount >= quoted_amount),
    CONSTRAINT generation_charge_task_fk FOREIGN KEY (tenant_id, task_id)
        REFERENCES generation_task (tenant_id, task_id) DEFERRABLE INITIALLY DEFERRED
);
CREATE TRIGGER generation_charge_fill_tenant BEFORE INSERT ON generation_charge
    FOR EACH ROW EXECUTE FUNCTION aivedio_fill_tenant_id('generation_task', 'task_id', 'task_id');

-- ch.20.5.3
CREATE TABLE credit_reservation (
    reservation_id     uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id          uuid   NOT NULL,
    wallet_id          uuid   NOT NULL,
    task_id            uuid   NOT NULL,
    quoted_amount      bigint NOT NULL CHECK (quoted_amount >= 0),
    reserved_amount    bigint NOT NULL
        CONSTRAINT credit_reservation_reserved_nonneg CHECK (reserved_amount >= 0),
    settled_amount     bigint NOT NULL DEFAULT 0
        CONSTRAINT credit_reservation_settled_nonneg CHECK (settled_amount >= 0),
    released_amount    bigint NOT NULL DEFAULT 0
        CONSTRAINT credit_reservation_released_nonneg CHECK (released_amount >= 0),
    refunded_amount    bigint NOT NULL DEFAULT 0
        CONSTRAINT credit_reservation_refunded_nonneg CHECK (refunded_amount >= 0),
    state              text   NOT NULL DEFAULT 'ACTIVE'
        CONSTRAINT credit_reservation_state_check
        CHECK (state IN ('ACTIVE', 'PARTIALLY_SETTLED', 'SETTLED', 'RELEASED',
                         'PARTIALLY_REFUNDED', 'REFUNDED')),
    price_version_id   uuid   NOT NULL REFERENCES price_book (price_version_id),
    charge_policy_code text,
    expires_at         timestamptz,
    version            bigint NOT NULL DEFAULT 0,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT credit_reservation_task_key UNIQUE (task_id),
    CONSTRAINT credit_reservation_settled_released_le_reserved
        CHECK (settled_amount + released_amount <= reserved_amount),
    CONSTRAINT credit_reservation_refunded_le_settled CHECK (refunded_amount <= settled_amount),
    CONSTRAINT credit_reservation_wallet_fk FOREIGN KEY (tenant_id, wallet_id)
        REFERENCES wallet_account (tenant_id, wallet_id) DEFERRABLE INITIALLY DEFERRED,
    CONSTRAINT credit_reservation_task_fk FOREIGN KEY (tenant_id, task_id)
        REFERENCES generation_task (tenant_id, task_id) DEFERRABLE INITIALLY DEFERRED
);
CREATE INDEX idx_credit_reservation_state ON credit_reservation (state, updated_at);
CREATE INDEX idx_credit_reservation_wallet ON credit_reservation (wallet_id);
CREATE TRIGGER credit_reservation_fill_tenant BEFORE INSERT ON credit_reservation
    FOR EACH ROW EXECUTE FUNCTION aivedio_fill_tenant_id('wallet_account', 'wallet_id', 'wallet_id');

-- Which lots a reservation drew from, so a release returns credit to the same lot.
CREATE TABLE reservation_allocation (
    reservation_id  uuid   NOT NULL REFERENCES credit_reservation (reservation_id) DEFERRABLE INITIALLY DEFERRED,
    lot_id          uuid   NOT NULL REFERENCES credit_lot (lot_id) DEFERRABLE INITIALLY DEFERRED,
    tenant_id       uuid   NOT NULL REFERENCES tenant (tenant_id),
    amount          bigint NOT NULL CONSTRAINT reservation_allocation_amount_positive CHECK (amount > 0),
    released_amount bigint NOT NULL DEFAULT 0 CHECK (released_amount >= 0),
    settled_amount  bigint NOT NULL DEFAULT 0 CHECK (settled_amount >= 0),
    PRIMARY KEY (reservation_id, lot_id),
    CONSTRAINT reservation_allocation_settled_released_le_amount
        CHECK (settled_amount + released_amount <= amount)
);
CREATE INDEX idx_reservation_allocation_lot ON reservation_allocation (lot_id);
CREATE TRIGGER reservation_allocation_fill_tenant BEFORE INSERT ON reservation_allocation
    FOR EACH ROW EXECUTE FUNCTION aivedio_fill_tenant_id('credit_reservation', 'reservation_id', 'reservation_id');

-- ch.20.5.2 transaction header. Append-only; business_key is the idempotency
-- guard of every balance effect (ch.20.8.2 keys, e.g. settle:generation:{task_id}:{v}).
CREATE TABLE ledger_transaction (
    ledger_txn_id  uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id      uuid NOT NULL,
    wallet_id      uuid NOT NULL,
    business_key   text NOT NULL CHECK (char_length(business_key) > 0),
    event_type     text NOT NULL
        CONSTRAINT ledger_transaction_event_type_check
        CHECK (event_type IN ('GRANT', 'RESERVE', 'SETTLE', 'RELEASE', 'REFUND',
                              'COMPENSATE', 'EXPIRE', 'ADJUST')),
    task_id        uuid,
    reservation_id uuid REFERENCES credit_reservation (reservation_id) DEFERRABLE INITIALLY DEFERRED,
    reversal_of    uuid,
    reason_code    text,
    metadata       jsonb NOT NULL DEFAULT '{}',
    created_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT ledger_transaction_wallet_business_key UNIQUE (wallet_id, business_key),
    CONSTRAINT ledger_transaction_txn_wallet_key UNIQUE (ledger_txn_id, wallet_id),
    CONSTRAINT ledger_transaction_wallet_fk FOREIGN KEY (tenant_id, wallet_id)
        REFERENCES wallet_account (tenant_id, wallet_id) DEFERRABLE INITIALLY DEFERRED,
    CONSTRAINT ledger_transaction_task_fk FOREIGN KEY (tenant_id, task_id)
        REFERENCES generation_task (tenant_id, task_id) DEFERRABLE INITIALLY DEFERRED,
    -- a reversal (e.g. REFUND of a SETTLE) stays in the same wallet
    CONSTRAINT ledger_transaction_reversal_fk FOREIGN KEY (reversal_of, wallet_id)
        REFERENCES ledger_transaction (ledger_txn_id, wallet_id) DEFERRABLE INITIALLY DEFERRED,
    CONSTRAINT ledger_transaction_not_self_reversal CHECK (reversal_of IS DISTINCT FROM ledger_txn_id)
);
CREATE INDEX idx_ledger_transaction_task ON ledger_transaction (task_id, created_at);
-- GET /v1/wallet/ledger: newest first with a keyset cursor
CREATE INDEX idx_ledger_transaction_wallet_created
    ON ledger_transaction (wallet_id, created_at DESC, ledger_txn_id DESC);
CREATE INDEX idx_ledger_transaction_reversal ON ledger_transaction (reversal_of) WHERE reversal_of IS NOT NULL;
CREATE TRIGGER ledger_transaction_fill_tenant BEFORE INSERT ON ledger_transaction
    FOR EACH ROW EXECUTE FUNCTION aivedio_fill_tenant_id('wallet_account', 'wallet_id', 'wallet_id');

-- ch.20.5.2 entries. Buckets: AVAILABLE/RESERVED/CONSUMED mirror the snapshot;
-- ISSUED is the contra bucket of credit entering the wallet (GRANT, COMPENSATE:
-- AVAILABLE +x / ISSUED -x) and EXPIRED receives expired credit (EXPIRE:
-- AVAILABLE -x / EXPIRED +x), so every transaction sums to zero.
CREATE TABLE ledger_entry (
    entry_id      uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    ledger_txn_id uuid   NOT NULL,
    tenant_id     uuid   NOT NULL,
    wallet_id     uuid   NOT NULL,
    lot_id        uuid REFERENCES credit_lot (lot_id) DEFERRABLE INITIALLY DEFERRED,
    bucket        text   NOT NULL
        CONSTRAINT ledger_entry_bucket_check
        CHECK (bucket IN ('AVAILABLE', 'RESERVED', 'CONSUMED', 'ISSUED', 'EXPIRED')),
    amount_delta  bigint NOT NULL CONSTRAINT ledger_entry_amount_nonzero CHECK (amount_delta <> 0),
    unit_code     text   NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- entry belongs to its transaction's wallet, and carries that wallet's unit
    CONSTRAINT ledger_entry_txn_fk FOREIGN KEY (ledger_txn_id, wallet_id)
        REFERENCES ledger_transaction (ledger_txn_id, wallet_id) DEFERRABLE INITIALLY DEFERRED,
    CONSTRAINT ledger_entry_wallet_unit_fk FOREIGN KEY (tenant_id, wallet_id, unit_code)
        REFERENCES wallet_account (tenant_id, wallet_id, unit_code) DEFERRABLE INITIALLY DEFERRED
);
CREATE INDEX idx_ledger_entry_txn ON ledger_entry (ledger_txn_id);
-- snapshot-vs-ledger reconciliation sums per wallet and bucket (ch.20.8.5)
CREATE INDEX idx_ledger_entry_wallet_bucket ON ledger_entry (wallet_id, bucket);
CREATE INDEX idx_ledger_entry_lot ON ledger_entry (lot_id) WHERE lot_id IS NOT NULL;

-- wallet_id, tenant_id and unit_code default from the transaction and wallet.
CREATE FUNCTION ledger_entry_defaults() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.wallet_id IS NULL OR NEW.tenant_id IS NULL OR NEW.unit_code IS NULL THEN
        SELECT coalesce(NEW.wallet_id, t.wallet_id),
               coalesce(NEW.tenant_id, t.tenant_id),
               coalesce(NEW.unit_code, w.unit_code)
          INTO NEW.wallet_id, NEW.tenant_id, NEW.unit_code
          FROM ledger_transaction t
          JOIN wallet_account w ON w.wallet_id = t.wallet_id
         WHERE t.ledger_txn_id = NEW.ledger_txn_id;
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER ledger_entry_defaults BEFORE INSERT ON ledger_entry
    FOR EACH ROW EXECUTE FUNCTION ledger_entry_defaults();

-- Double entry: checked at commit so entries can be inserted one by one.
CREATE FUNCTION ledger_entry_assert_balanced() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    total numeric;
BEGIN
    SELECT sum(amount_delta) INTO total FROM ledger_entry WHERE ledger_txn_id = NEW.ledger_txn_id;
    IF total <> 0 THEN
        RAISE EXCEPTION 'ledger transaction % is unbalanced: entries sum to %', NEW.ledger_txn_id, total
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_entry_balanced';
    END IF;
    RETURN NULL;
END;
$$;
CREATE CONSTRAINT TRIGGER ledger_entry_balanced
    AFTER INSERT ON ledger_entry
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION ledger_entry_assert_balanced();

-- A transaction header without entries is not a balance effect; refuse it.
CREATE FUNCTION ledger_transaction_assert_has_entries() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM ledger_entry WHERE ledger_txn_id = NEW.ledger_txn_id) THEN
        RAISE EXCEPTION 'ledger transaction % (%) has no entries', NEW.ledger_txn_id, NEW.business_key
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_transaction_has_entries';
    END IF;
    RETURN NULL;
END;
$$;
CREATE CONSTRAINT TRIGGER ledger_transaction_has_entries
    AFTER INSERT ON ledger_transaction
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION ledger_transaction_assert_has_entries();

CREATE TRIGGER ledger_transaction_append_only BEFORE UPDATE OR DELETE ON ledger_transaction
    FOR EACH ROW EXECUTE FUNCTION aivedio_forbid_mutation();
CREATE TRIGGER ledger_transaction_no_truncate BEFORE TRUNCATE ON ledger_transaction
    FOR EACH STATEMENT EXECUTE FUNCTION aivedio_forbid_mutation();
CREATE TRIGGER ledger_entry_append_only BEFORE UPDATE OR DELETE ON ledger_entry
    FOR EACH ROW EXECUTE FUNCTION aivedio_forbid_mutation();
CREATE TRIGGER ledger_entry_no_truncate BEFORE TRUNCATE ON ledger_entry
    FOR EACH STATEMENT EXECUTE FUNCTION aivedio_forbid_mutation();

-- Which lots a SETTLE consumed, so a refund goes back to the lot it came from (ch.20.5.8).
CREATE TABLE settlement_allocation (
    ledger_txn_id   uuid   NOT NULL REFERENCES ledger_transaction (ledger_txn_id) DEFERRABLE INITIALLY DEFERRED,
    lot_id          uuid   NOT NULL REFERENCES credit_lot (lot_id) DEFERRABLE INITIALLY DEFERRED,
    tenant_id       uuid   NOT NULL REFERENCES tenant (tenant_id),
    amount          bigint NOT NULL CONSTRAINT settlement_allocation_amount_positive CHECK (amount > 0),
    refunded_amount bigint NOT NULL DEFAULT 0 CHECK (refunded_amount >= 0),
    PRIMARY KEY (ledger_txn_id, lot_id),
    CONSTRAINT settlement_allocation_refunded_le_amount CHECK (refunded_amount <= amount)
);
CREATE INDEX idx_settlement_allocation_lot ON settlement_allocation (lot_id);
CREATE TRIGGER settlement_allocation_fill_tenant BEFORE INSERT ON settlement_allocation
    FOR EACH ROW EXECUTE FUNCTION aivedio_fill_tenant_id('ledger_transaction', 'ledger_txn_id', 'ledger_txn_id');

-- ch.20.7.6: a refund references an existing SETTLE, else waits in PENDING_SETTLEMENT.
CREATE TABLE refund_request (
    refund_id            uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id            uuid   NOT NULL,
    task_id              uuid   NOT NULL,
    settle_ledger_txn_id uuid REFERENCES ledger_transaction (ledger_txn_id) DEFERRABLE INITIALLY DEFERRED,
    refund_ledger_txn_id uuid REFERENCES ledger_transaction (ledger_txn_id) DEFERRABLE INITIALLY DEFERRED,
    amount               bigint NOT NULL CONSTRAINT refund_request_amount_positive CHECK (amount > 0),
    state                text   NOT NULL DEFAULT 'PENDING_SETTLEMENT'
        CONSTRAINT refund_request_state_check CHECK (state IN ('PENDING_SETTLEMENT', 'COMPLETED', 'REJECTED')),
    reason               text,
    requested_by         text   NOT NULL,
    created_at           timestamptz NOT NULL DEFAULT now(),
    completed_at         timestamptz,
    CONSTRAINT refund_request_task_fk FOREIGN KEY (tenant_id, task_id)
        REFERENCES generation_task (tenant_id, task_id) DEFERRABLE INITIALLY DEFERRED
);
CREATE INDEX idx_refund_request_task ON refund_request (task_id);
CREATE INDEX idx_refund_request_pending ON refund_request (created_at) WHERE state = 'PENDING_SETTLEMENT';
CREATE TRIGGER refund_request_fill_tenant BEFORE INSERT ON refund_request
    FOR EACH ROW EXECUTE FUNCTION aivedio_fill_tenant_id('generation_task', 'task_id', 'task_id');

-- Goodwill credit under approval (ch.20.6.7); business key compensate:{case_id}.
CREATE TABLE compensation_case (
    case_id       text   NOT NULL,
    tenant_id     uuid   NOT NULL REFERENCES tenant (tenant_id),
    wallet_id     uuid   NOT NULL,
    amount        bigint NOT NULL CONSTRAINT compensation_case_amount_positive CHECK (amount > 0),
    reason_code   text   NOT NULL,
    evidence      jsonb  NOT NULL DEFAULT '{}',
    state         text   NOT NULL DEFAULT 'PENDING_APPROVAL'
        CONSTRAINT compensation_case_state_check
        CHECK (state IN ('PENDING_APPROVAL', 'APPROVED', 'APPLIED', 'REJECTED')),
    requested_by  text   NOT NULL,
    approvals     jsonb  NOT NULL DEFAULT '[]',
    ledger_txn_id uuid REFERENCES ledger_transaction (ledger_txn_id) DEFERRABLE INITIALLY DEFERRED,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, case_id),
    CONSTRAINT compensation_case_wallet_fk FOREIGN KEY (tenant_id, wallet_id)
        REFERENCES wallet_account (tenant_id, wallet_id) DEFERRABLE INITIALLY DEFERRED
);

-- ch.20.5.6: spend budgets, reserved per attempt and settled with actual cost.
-- No reserved+consumed <= limit CHECK: actual provider cost can overrun the
-- estimate after the fact; admission enforces the limit at reserve time.
CREATE TABLE budget_account (
    budget_id       uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    scope_type      text NOT NULL
        CONSTRAINT budget_account_scope_type_check
        CHECK (scope_type IN ('TENANT', 'PROJECT', 'PROVIDER_ACCOUNT', 'MODEL', 'REGION', 'GLOBAL')),
    scope_id        text NOT NULL,
    tenant_id       uuid REFERENCES tenant (tenant_id),
    period_start    timestamptz NOT NULL,
    period_end      timestamptz NOT NULL,
    limit_amount    numeric(20, 8) NOT NULL CHECK (limit_amount >= 0),
    reserved_amount numeric(20, 8) NOT NULL DEFAULT 0
        CONSTRAINT budget_account_reserved_nonneg CHECK (reserved_amount >= 0),
    consumed_amount numeric(20, 8) NOT NULL DEFAULT 0
        CONSTRAINT budget_account_consumed_nonneg CHECK (consumed_amount >= 0),
    currency        text NOT NULL,
    version         bigint NOT NULL DEFAULT 0,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT budget_account_scope_period_key
        UNIQUE (scope_type, scope_id, period_start, period_end, currency),
    CONSTRAINT budget_account_period CHECK (period_end > period_start)
);

-- Business key e.g. provider-budget-reserve:{attempt_id}; include the budget or
-- scope in it when one attempt reserves against several budgets.
CREATE TABLE budget_reservation (
    budget_reservation_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    budget_id       uuid NOT NULL REFERENCES budget_account (budget_id) DEFERRABLE INITIALLY DEFERRED,
    tenant_id       uuid REFERENCES tenant (tenant_id),
    attempt_id      uuid REFERENCES task_attempt (attempt_id) DEFERRABLE INITIALLY DEFERRED,
    task_id         uuid REFERENCES generation_task (task_id) DEFERRABLE INITIALLY DEFERRED,
    business_key    text NOT NULL CONSTRAINT budget_reservation_business_key UNIQUE,
    amount          numeric(20, 8) NOT NULL CHECK (amount >= 0),
    settled_amount  numeric(20, 8) NOT NULL DEFAULT 0 CHECK (settled_amount >= 0),
    released_amount numeric(20, 8) NOT NULL DEFAULT 0 CHECK (released_amount >= 0),
    state           text NOT NULL DEFAULT 'ACTIVE',
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT budget_reservation_settled_released_le_amount
        CHECK (settled_amount + released_amount <= amount)
);
CREATE INDEX idx_budget_reservation_budget_state ON budget_reservation (budget_id, state);
CREATE INDEX idx_budget_reservation_attempt ON budget_reservation (attempt_id) WHERE attempt_id IS NOT NULL;
