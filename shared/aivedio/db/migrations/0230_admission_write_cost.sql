-- 0230: what an admission costs the database (issue 15: at most 2.5x a tpcb-like transaction's CPU),
-- and big tenants (many users behind one wallet). Measured with callgrind on the backends, in
-- instructions per admission (repeatable on a shared machine, unlike CPU time), three processes
-- admitting over 40 tenants: 7.00M before this migration, 4.35M after; a tpcb-like transaction is
-- 0.675M. Where they went, and what changes here (each guarantee is kept, where it is cheaper):
--
-- 1. CHECK constraints (1.5M). PostgreSQL reads a table's check expressions back from their stored
--    text and plans them in every statement that writes the table (ExecRelCheck), all of them on
--    every insert and update, whichever columns change; an enumeration's array of text constants is
--    read byte by byte. A domain's checks are read once per backend (the type cache), and evaluated
--    only where a value of the column is written. So each single-column check of the tables an
--    admission writes becomes its column's domain, under the constraint's own name (an error still
--    names generation_task_state_check). The checks over several columns stay table checks, and so
--    does priority_band's: a band over 4 that the defaults trigger copies into base_priority_band is
--    refused under base_priority_band_check (the domain's check, at the trigger's assignment), which
--    came first in name order before.
-- 2. The ledger's balance (0.73M): a deferred trigger per entry summed its transaction once per
--    entry, and another per transaction counted the entries. One deferred trigger per transaction
--    now checks both at commit, with the same constraint names; an entry's key names its database
--    transaction, so none is added to a committed one (section 3).
-- 3. Foreign keys (1.5M; each check is a query of its own): fewer keys name the same rows (an
--    allocation its reservation and tenant, an entry its transaction, tenant, wallet and unit), the
--    idempotency record's key to its tenant goes (the task's key checks it), and aivedio_admit checks
--    its keys inside itself, where its plans read by key: on the small tables every admission updates
--    (a wallet row per tenant, a lot per wallet) the planner chose sequential scans, which read every
--    dead row version the admissions left since the last vacuum.
-- 4. aivedio_expected_wait is plain SQL, which the planner inlines into the caller's expression.
-- 5. The tenant's queue counts come from at most 64 rows per lane (tenant_queue_usage), not a row per
--    user: an admission of a tenant with 2,000 users' rows cost 10.6M, now 4.7M (an ordinary one 4.6M).
-- 6. A POSTPAID wallet can be partitioned (its allowances are of its credit line, of no lot).
-- 7. aivedio_admit makes the same checks and writes in fewer statements: the wallet is locked by the
--    statement that finds it (unless it is partitioned: the allowances are locked first), the
--    idempotency record, the queue usage and the cost windows are read in one statement, a slot's
--    allowance rows are locked and read in one, and the task, reservation, allocations, ledger
--    transaction and entries, lots, wallet snapshot, charge, cost windows and outbox row are written
--    by one.
-- The migration rewrites no table: columns are retyped to domains in place, and added without a
-- default first; it scans the tables once for the domains' checks and the new keys.

-- 1. Single-column checks as domains. Each column is retyped to a domain without checks first (the
-- same representation: no table is rewritten, and the indexes are kept but for partial ones whose
-- predicate names a retyped column), then the domains get their checks, each validated by a scan of
-- the rows that are there. The queue usage triggers name columns retyped here: dropped first, then
-- made again as 0190 made them.
DROP TRIGGER generation_task_queue_usage_insert ON generation_task;
DROP TRIGGER generation_task_queue_usage_update ON generation_task;
DROP TRIGGER generation_task_queue_usage_delete ON generation_task;

-- credit_lot
CREATE DOMAIN credit_lot_kind AS text;
CREATE DOMAIN credit_lot_original_amount AS bigint;
CREATE DOMAIN credit_lot_remaining_amount AS bigint;
CREATE DOMAIN credit_lot_reserved_amount AS bigint;
CREATE DOMAIN credit_lot_expired_amount AS bigint;
ALTER TABLE credit_lot
    DROP CONSTRAINT credit_lot_kind_check,
    DROP CONSTRAINT credit_lot_original_positive,
    DROP CONSTRAINT credit_lot_remaining_nonneg,
    DROP CONSTRAINT credit_lot_reserved_nonneg,
    DROP CONSTRAINT credit_lot_expired_nonneg,
    ALTER COLUMN kind TYPE credit_lot_kind,
    ALTER COLUMN original_amount TYPE credit_lot_original_amount,
    ALTER COLUMN remaining_amount TYPE credit_lot_remaining_amount,
    ALTER COLUMN reserved_amount TYPE credit_lot_reserved_amount,
    ALTER COLUMN expired_amount TYPE credit_lot_expired_amount;
-- credit_reservation
CREATE DOMAIN credit_reservation_quoted_amount AS bigint;
CREATE DOMAIN credit_reservation_reserved_amount AS bigint;
CREATE DOMAIN credit_reservation_settled_amount AS bigint;
CREATE DOMAIN credit_reservation_released_amount AS bigint;
CREATE DOMAIN credit_reservation_refunded_amount AS bigint;
CREATE DOMAIN credit_reservation_state AS text;
ALTER TABLE credit_reservation
    DROP CONSTRAINT credit_reservation_quoted_amount_check,
    DROP CONSTRAINT credit_reservation_reserved_nonneg,
    DROP CONSTRAINT credit_reservation_settled_nonneg,
    DROP CONSTRAINT credit_reservation_released_nonneg,
    DROP CONSTRAINT credit_reservation_refunded_nonneg,
    DROP CONSTRAINT credit_reservation_state_check,
    ALTER COLUMN quoted_amount TYPE credit_reservation_quoted_amount,
    ALTER COLUMN reserved_amount TYPE credit_reservation_reserved_amount,
    ALTER COLUMN settled_amount TYPE credit_reservation_settled_amount,
    ALTER COLUMN released_amount TYPE credit_reservation_released_amount,
    ALTER COLUMN refunded_amount TYPE credit_reservation_refunded_amount,
    ALTER COLUMN state TYPE credit_reservation_state;
-- generation_charge
CREATE DOMAIN generation_charge_quoted_amount AS bigint;
CREATE DOMAIN generation_charge_max_reserve_amount AS bigint;
CREATE DOMAIN generation_charge_final_charge_amount AS bigint;
CREATE DOMAIN generation_charge_charge_version AS integer;
CREATE DOMAIN generation_charge_absorbed_amount AS bigint;
CREATE DOMAIN generation_charge_delivered_seconds AS integer;
ALTER TABLE generation_charge
    DROP CONSTRAINT generation_charge_quoted_amount_check,
    DROP CONSTRAINT generation_charge_max_reserve_amount_check,
    DROP CONSTRAINT generation_charge_final_charge_amount_check,
    DROP CONSTRAINT generation_charge_charge_version_check,
    DROP CONSTRAINT generation_charge_absorbed_amount_check,
    DROP CONSTRAINT generation_charge_delivered_seconds_check,
    ALTER COLUMN quoted_amount TYPE generation_charge_quoted_amount,
    ALTER COLUMN max_reserve_amount TYPE generation_charge_max_reserve_amount,
    ALTER COLUMN final_charge_amount TYPE generation_charge_final_charge_amount,
    ALTER COLUMN charge_version TYPE generation_charge_charge_version,
    ALTER COLUMN absorbed_amount TYPE generation_charge_absorbed_amount,
    ALTER COLUMN delivered_seconds TYPE generation_charge_delivered_seconds;
-- generation_task
CREATE DOMAIN generation_task_queue_class AS text;
CREATE DOMAIN generation_task_state AS text;
CREATE DOMAIN generation_task_version AS bigint;
CREATE DOMAIN generation_task_fairness_units AS bigint;
CREATE DOMAIN generation_task_provider_slot_units AS bigint;
CREATE DOMAIN generation_task_estimated_cost_units AS bigint;
CREATE DOMAIN generation_task_idempotency_key AS text;
CREATE DOMAIN generation_task_mode AS text;
CREATE DOMAIN generation_task_duration_seconds AS integer;
CREATE DOMAIN generation_task_resolution AS text;
CREATE DOMAIN generation_task_gpu_units AS bigint;
CREATE DOMAIN generation_task_media_units AS bigint;
CREATE DOMAIN generation_task_base_priority_band AS smallint;
CREATE DOMAIN generation_task_aging_promotions AS smallint;
CREATE DOMAIN generation_task_skip_count AS integer;
CREATE DOMAIN generation_task_capacity_mode AS text;
ALTER TABLE generation_task
    DROP CONSTRAINT generation_task_queue_class_check,
    DROP CONSTRAINT generation_task_state_check,
    DROP CONSTRAINT generation_task_version_check,
    DROP CONSTRAINT generation_task_fairness_units_check,
    DROP CONSTRAINT generation_task_provider_slot_units_check,
    DROP CONSTRAINT generation_task_estimated_cost_units_check,
    DROP CONSTRAINT generation_task_idempotency_key_length,
    DROP CONSTRAINT generation_task_mode_check,
    DROP CONSTRAINT generation_task_duration_seconds_check,
    DROP CONSTRAINT generation_task_resolution_check,
    DROP CONSTRAINT generation_task_gpu_units_check,
    DROP CONSTRAINT generation_task_media_units_check,
    DROP CONSTRAINT generation_task_base_priority_band_check,
    DROP CONSTRAINT generation_task_aging_promotions_check,
    DROP CONSTRAINT generation_task_skip_count_check,
    DROP CONSTRAINT generation_task_capacity_mode_check,
    ALTER COLUMN queue_class TYPE generation_task_queue_class,
    ALTER COLUMN state TYPE generation_task_state,
    ALTER COLUMN version TYPE generation_task_version,
    ALTER COLUMN fairness_units TYPE generation_task_fairness_units,
    ALTER COLUMN provider_slot_units TYPE generation_task_provider_slot_units,
    ALTER COLUMN estimated_cost_units TYPE generation_task_estimated_cost_units,
    ALTER COLUMN idempotency_key TYPE generation_task_idempotency_key,
    ALTER COLUMN mode TYPE generation_task_mode,
    ALTER COLUMN duration_seconds TYPE generation_task_duration_seconds,
    ALTER COLUMN resolution TYPE generation_task_resolution,
    ALTER COLUMN gpu_units TYPE generation_task_gpu_units,
    ALTER COLUMN media_units TYPE generation_task_media_units,
    ALTER COLUMN base_priority_band TYPE generation_task_base_priority_band,
    ALTER COLUMN aging_promotions TYPE generation_task_aging_promotions,
    ALTER COLUMN skip_count TYPE generation_task_skip_count,
    ALTER COLUMN capacity_mode TYPE generation_task_capacity_mode;
-- idempotency_record
CREATE DOMAIN idempotency_record_idempotency_key AS text;
CREATE DOMAIN idempotency_record_status AS text;
ALTER TABLE idempotency_record
    DROP CONSTRAINT idempotency_record_key_length,
    DROP CONSTRAINT idempotency_record_status_check,
    ALTER COLUMN idempotency_key TYPE idempotency_record_idempotency_key,
    ALTER COLUMN status TYPE idempotency_record_status;
-- ledger_entry
CREATE DOMAIN ledger_entry_bucket AS text;
CREATE DOMAIN ledger_entry_amount_delta AS bigint;
ALTER TABLE ledger_entry
    DROP CONSTRAINT ledger_entry_bucket_check,
    DROP CONSTRAINT ledger_entry_amount_nonzero,
    ALTER COLUMN bucket TYPE ledger_entry_bucket,
    ALTER COLUMN amount_delta TYPE ledger_entry_amount_delta;
-- ledger_transaction
CREATE DOMAIN ledger_transaction_business_key AS text;
CREATE DOMAIN ledger_transaction_event_type AS text;
ALTER TABLE ledger_transaction
    DROP CONSTRAINT ledger_transaction_business_key_check,
    DROP CONSTRAINT ledger_transaction_event_type_check,
    ALTER COLUMN business_key TYPE ledger_transaction_business_key,
    ALTER COLUMN event_type TYPE ledger_transaction_event_type;
-- outbox_event
CREATE DOMAIN outbox_event_status AS text;
CREATE DOMAIN outbox_event_attempts AS integer;
ALTER TABLE outbox_event
    DROP CONSTRAINT outbox_event_status_check,
    DROP CONSTRAINT outbox_event_attempts_check,
    ALTER COLUMN status TYPE outbox_event_status,
    ALTER COLUMN attempts TYPE outbox_event_attempts;
-- reservation_allocation
CREATE DOMAIN reservation_allocation_amount AS bigint;
CREATE DOMAIN reservation_allocation_released_amount AS bigint;
CREATE DOMAIN reservation_allocation_settled_amount AS bigint;
ALTER TABLE reservation_allocation
    DROP CONSTRAINT reservation_allocation_amount_positive,
    DROP CONSTRAINT reservation_allocation_released_amount_check,
    DROP CONSTRAINT reservation_allocation_settled_amount_check,
    ALTER COLUMN amount TYPE reservation_allocation_amount,
    ALTER COLUMN released_amount TYPE reservation_allocation_released_amount,
    ALTER COLUMN settled_amount TYPE reservation_allocation_settled_amount;
-- tenant_cost_window
CREATE DOMAIN tenant_cost_window_window_kind AS text;
CREATE DOMAIN tenant_cost_window_cost_units AS bigint;
ALTER TABLE tenant_cost_window
    DROP CONSTRAINT tenant_cost_window_window_kind_check,
    DROP CONSTRAINT tenant_cost_window_cost_units_check,
    ALTER COLUMN window_kind TYPE tenant_cost_window_window_kind,
    ALTER COLUMN cost_units TYPE tenant_cost_window_cost_units;
-- wallet_account
CREATE DOMAIN wallet_account_account_type AS text;
CREATE DOMAIN wallet_account_reserved_amount AS bigint;
CREATE DOMAIN wallet_account_credit_limit_amount AS bigint;
CREATE DOMAIN wallet_account_consumed_amount AS bigint;
ALTER TABLE wallet_account
    DROP CONSTRAINT wallet_account_type_check,
    DROP CONSTRAINT wallet_account_reserved_nonneg,
    DROP CONSTRAINT wallet_account_credit_limit_nonneg,
    DROP CONSTRAINT wallet_account_consumed_nonneg,
    ALTER COLUMN account_type TYPE wallet_account_account_type,
    ALTER COLUMN reserved_amount TYPE wallet_account_reserved_amount,
    ALTER COLUMN credit_limit_amount TYPE wallet_account_credit_limit_amount,
    ALTER COLUMN consumed_amount TYPE wallet_account_consumed_amount;


-- The domains' checks, each validated over the rows that are there (a scan, no rewrite).
ALTER DOMAIN credit_lot_kind ADD CONSTRAINT credit_lot_kind_check CHECK (VALUE = ANY (ARRAY['PAID', 'SUBSCRIPTION', 'PROMOTIONAL', 'COMPENSATION']));
ALTER DOMAIN credit_lot_original_amount ADD CONSTRAINT credit_lot_original_positive CHECK (VALUE > 0);
ALTER DOMAIN credit_lot_remaining_amount ADD CONSTRAINT credit_lot_remaining_nonneg CHECK (VALUE >= 0);
ALTER DOMAIN credit_lot_reserved_amount ADD CONSTRAINT credit_lot_reserved_nonneg CHECK (VALUE >= 0);
ALTER DOMAIN credit_lot_expired_amount ADD CONSTRAINT credit_lot_expired_nonneg CHECK (VALUE >= 0);
ALTER DOMAIN credit_reservation_quoted_amount ADD CONSTRAINT credit_reservation_quoted_amount_check CHECK (VALUE >= 0);
ALTER DOMAIN credit_reservation_reserved_amount ADD CONSTRAINT credit_reservation_reserved_nonneg CHECK (VALUE >= 0);
ALTER DOMAIN credit_reservation_settled_amount ADD CONSTRAINT credit_reservation_settled_nonneg CHECK (VALUE >= 0);
ALTER DOMAIN credit_reservation_released_amount ADD CONSTRAINT credit_reservation_released_nonneg CHECK (VALUE >= 0);
ALTER DOMAIN credit_reservation_refunded_amount ADD CONSTRAINT credit_reservation_refunded_nonneg CHECK (VALUE >= 0);
ALTER DOMAIN credit_reservation_state ADD CONSTRAINT credit_reservation_state_check CHECK (VALUE = ANY (ARRAY['ACTIVE', 'PARTIALLY_SETTLED', 'SETTLED', 'RELEASED', 'PARTIALLY_REFUNDED', 'REFUNDED']));
ALTER DOMAIN generation_charge_quoted_amount ADD CONSTRAINT generation_charge_quoted_amount_check CHECK (VALUE >= 0);
ALTER DOMAIN generation_charge_max_reserve_amount ADD CONSTRAINT generation_charge_max_reserve_amount_check CHECK (VALUE >= 0);
ALTER DOMAIN generation_charge_final_charge_amount ADD CONSTRAINT generation_charge_final_charge_amount_check CHECK (VALUE >= 0);
ALTER DOMAIN generation_charge_charge_version ADD CONSTRAINT generation_charge_charge_version_check CHECK (VALUE >= 1);
ALTER DOMAIN generation_charge_absorbed_amount ADD CONSTRAINT generation_charge_absorbed_amount_check CHECK (VALUE >= 0);
ALTER DOMAIN generation_charge_delivered_seconds ADD CONSTRAINT generation_charge_delivered_seconds_check CHECK (VALUE >= 0);
ALTER DOMAIN generation_task_queue_class ADD CONSTRAINT generation_task_queue_class_check CHECK (VALUE = ANY (ARRAY['ENTERPRISE_RESERVED', 'PAID_SHARED', 'STANDARD', 'BEST_EFFORT', 'EXPENSIVE', 'RECOVERY']));
ALTER DOMAIN generation_task_state ADD CONSTRAINT generation_task_state_check CHECK (VALUE = ANY (ARRAY['QUEUED', 'DISPATCHING', 'SUBMITTED', 'RUNNING', 'SUBMIT_UNKNOWN', 'CANCEL_REQUESTED', 'PROVIDER_SUCCEEDED', 'MEDIA_PROCESSING', 'SUCCEEDED', 'FAILED', 'CANCELLED', 'MEDIA_INGEST_FAILED', 'MANUAL_REVIEW']));
ALTER DOMAIN generation_task_version ADD CONSTRAINT generation_task_version_check CHECK (VALUE >= 0);
ALTER DOMAIN generation_task_fairness_units ADD CONSTRAINT generation_task_fairness_units_check CHECK (VALUE >= 0);
ALTER DOMAIN generation_task_provider_slot_units ADD CONSTRAINT generation_task_provider_slot_units_check CHECK (VALUE >= 0);
ALTER DOMAIN generation_task_estimated_cost_units ADD CONSTRAINT generation_task_estimated_cost_units_check CHECK (VALUE >= 0);
ALTER DOMAIN generation_task_idempotency_key ADD CONSTRAINT generation_task_idempotency_key_length CHECK ((char_length(VALUE) >= 1) AND (char_length(VALUE) <= 255));
ALTER DOMAIN generation_task_mode ADD CONSTRAINT generation_task_mode_check CHECK (VALUE = ANY (ARRAY['text_to_video', 'image_to_video', 'video_to_video', 'extend']));
ALTER DOMAIN generation_task_duration_seconds ADD CONSTRAINT generation_task_duration_seconds_check CHECK (VALUE > 0);
ALTER DOMAIN generation_task_resolution ADD CONSTRAINT generation_task_resolution_check CHECK (VALUE = ANY (ARRAY['480p', '720p', '1080p', '4k']));
ALTER DOMAIN generation_task_gpu_units ADD CONSTRAINT generation_task_gpu_units_check CHECK (VALUE >= 0);
ALTER DOMAIN generation_task_media_units ADD CONSTRAINT generation_task_media_units_check CHECK (VALUE >= 0);
ALTER DOMAIN generation_task_base_priority_band ADD CONSTRAINT generation_task_base_priority_band_check CHECK ((VALUE >= 0) AND (VALUE <= 4));
ALTER DOMAIN generation_task_aging_promotions ADD CONSTRAINT generation_task_aging_promotions_check CHECK (VALUE >= 0);
ALTER DOMAIN generation_task_skip_count ADD CONSTRAINT generation_task_skip_count_check CHECK (VALUE >= 0);
ALTER DOMAIN generation_task_capacity_mode ADD CONSTRAINT generation_task_capacity_mode_check CHECK (VALUE = ANY (ARRAY['NORMAL', 'BORROWED']));
ALTER DOMAIN idempotency_record_idempotency_key ADD CONSTRAINT idempotency_record_key_length CHECK ((char_length(VALUE) >= 1) AND (char_length(VALUE) <= 255));
ALTER DOMAIN idempotency_record_status ADD CONSTRAINT idempotency_record_status_check CHECK (VALUE = ANY (ARRAY['IN_PROGRESS', 'COMPLETED']));
ALTER DOMAIN ledger_entry_bucket ADD CONSTRAINT ledger_entry_bucket_check CHECK (VALUE = ANY (ARRAY['AVAILABLE', 'RESERVED', 'CONSUMED', 'ISSUED', 'EXPIRED']));
ALTER DOMAIN ledger_entry_amount_delta ADD CONSTRAINT ledger_entry_amount_nonzero CHECK (VALUE <> 0);
ALTER DOMAIN ledger_transaction_business_key ADD CONSTRAINT ledger_transaction_business_key_check CHECK (char_length(VALUE) > 0);
ALTER DOMAIN ledger_transaction_event_type ADD CONSTRAINT ledger_transaction_event_type_check CHECK (VALUE = ANY (ARRAY['GRANT', 'RESERVE', 'SETTLE', 'RELEASE', 'REFUND', 'COMPENSATE', 'EXPIRE', 'ADJUST']));
ALTER DOMAIN outbox_event_status ADD CONSTRAINT outbox_event_status_check CHECK (VALUE = ANY (ARRAY['PENDING', 'PUBLISHED', 'FAILED']));
ALTER DOMAIN outbox_event_attempts ADD CONSTRAINT outbox_event_attempts_check CHECK (VALUE >= 0);
ALTER DOMAIN reservation_allocation_amount ADD CONSTRAINT reservation_allocation_amount_positive CHECK (VALUE > 0);
ALTER DOMAIN reservation_allocation_released_amount ADD CONSTRAINT reservation_allocation_released_amount_check CHECK (VALUE >= 0);
ALTER DOMAIN reservation_allocation_settled_amount ADD CONSTRAINT reservation_allocation_settled_amount_check CHECK (VALUE >= 0);
ALTER DOMAIN tenant_cost_window_window_kind ADD CONSTRAINT tenant_cost_window_window_kind_check CHECK (VALUE = ANY (ARRAY['MINUTE', 'DAY']));
ALTER DOMAIN tenant_cost_window_cost_units ADD CONSTRAINT tenant_cost_window_cost_units_check CHECK (VALUE >= 0);
ALTER DOMAIN wallet_account_account_type ADD CONSTRAINT wallet_account_type_check CHECK (VALUE = ANY (ARRAY['PREPAID', 'SUBSCRIPTION', 'POSTPAID']));
ALTER DOMAIN wallet_account_reserved_amount ADD CONSTRAINT wallet_account_reserved_nonneg CHECK (VALUE >= 0);
ALTER DOMAIN wallet_account_credit_limit_amount ADD CONSTRAINT wallet_account_credit_limit_nonneg CHECK (VALUE >= 0);
ALTER DOMAIN wallet_account_consumed_amount ADD CONSTRAINT wallet_account_consumed_nonneg CHECK (VALUE >= 0);

CREATE TRIGGER generation_task_queue_usage_insert AFTER INSERT ON generation_task
    FOR EACH ROW WHEN (NEW.state = 'QUEUED') EXECUTE FUNCTION aivedio_task_queue_usage();
CREATE TRIGGER generation_task_queue_usage_update AFTER UPDATE ON generation_task
    FOR EACH ROW WHEN ((OLD.state = 'QUEUED' OR NEW.state = 'QUEUED')
                       AND (OLD.state, OLD.tenant_id, OLD.user_id, OLD.queue_class, OLD.fairness_units)
                           IS DISTINCT FROM (NEW.state, NEW.tenant_id, NEW.user_id, NEW.queue_class, NEW.fairness_units))
    EXECUTE FUNCTION aivedio_task_queue_usage();
CREATE TRIGGER generation_task_queue_usage_delete AFTER DELETE ON generation_task
    FOR EACH ROW WHEN (OLD.state = 'QUEUED') EXECUTE FUNCTION aivedio_task_queue_usage();

-- 2. The balance of a ledger transaction, checked once, at commit (the errors keep their constraint
-- names: ledger_transaction_has_entries, ledger_entry_balanced).
DROP TRIGGER ledger_entry_balanced ON ledger_entry;
DROP FUNCTION ledger_entry_assert_balanced();
DROP TRIGGER ledger_transaction_has_entries ON ledger_transaction;
DROP FUNCTION ledger_transaction_assert_has_entries();
CREATE FUNCTION ledger_transaction_assert_balanced() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
    total numeric;
BEGIN
    SELECT count(*), sum(amount_delta) INTO n, total FROM ledger_entry WHERE ledger_txn_id = NEW.ledger_txn_id;
    IF n = 0 THEN
        RAISE EXCEPTION 'ledger transaction % (%) has no entries', NEW.ledger_txn_id, NEW.business_key
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_transaction_has_entries';
    END IF;
    IF total <> 0 THEN
        RAISE EXCEPTION 'ledger transaction % is unbalanced: entries sum to %', NEW.ledger_txn_id, total
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_entry_balanced';
    END IF;
    RETURN NULL;
END;
$$;
CREATE CONSTRAINT TRIGGER ledger_transaction_balanced
    AFTER INSERT ON ledger_transaction
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION ledger_transaction_assert_balanced();

-- 3. Fewer foreign-key checks for the same guarantees (each check is a query of its own).
-- An allocation's reservation, of its tenant: one key instead of two, and the tenant is now the
-- reservation's.
ALTER TABLE credit_reservation ADD CONSTRAINT credit_reservation_tenant_reservation_key UNIQUE (tenant_id, reservation_id);
ALTER TABLE reservation_allocation
    DROP CONSTRAINT reservation_allocation_tenant_id_fkey,
    DROP CONSTRAINT reservation_allocation_reservation_id_fkey,
    ADD CONSTRAINT reservation_allocation_reservation_fk FOREIGN KEY (tenant_id, reservation_id)
        REFERENCES credit_reservation (tenant_id, reservation_id) DEFERRABLE INITIALLY DEFERRED;
-- A ledger entry named its transaction (and wallet) in one key and its wallet (tenant, wallet, unit)
-- in another. The transaction now carries its wallet's unit, so one key of the entry's names its
-- transaction, tenant, wallet and unit, and the transaction's own key names the wallet by all
-- three: the same guarantee, one check per entry less. A reversal names its original the same way.
-- The entry's key names one thing more, the database transaction that wrote it: header and entry
-- carry its id (created_xid, pg_current_xact_id() by default), so an entry appended to a committed
-- transaction is refused, as the balance trigger per entry used to refuse an unbalanced one
-- (section 2 checks the balance once per transaction, at commit). Rows from before this migration
-- keep a null id: their keys are not checked again. The backfill edits the append-only header rows
-- once, here, with their guard off; the columns get their default after they are added, so nothing
-- is rewritten.
ALTER TABLE ledger_transaction ADD COLUMN unit_code text, ADD COLUMN created_xid xid8;
ALTER TABLE ledger_entry ADD COLUMN created_xid xid8;
ALTER TABLE ledger_transaction ALTER COLUMN created_xid SET DEFAULT pg_current_xact_id();
ALTER TABLE ledger_entry ALTER COLUMN created_xid SET DEFAULT pg_current_xact_id();
ALTER TABLE ledger_transaction DISABLE TRIGGER ledger_transaction_append_only;
UPDATE ledger_transaction t SET unit_code = w.unit_code FROM wallet_account w WHERE w.wallet_id = t.wallet_id;
ALTER TABLE ledger_transaction ENABLE TRIGGER ledger_transaction_append_only;
ALTER TABLE ledger_transaction ALTER COLUMN unit_code SET NOT NULL;
ALTER TABLE ledger_entry DROP CONSTRAINT ledger_entry_txn_fk, DROP CONSTRAINT ledger_entry_wallet_unit_fk;
ALTER TABLE ledger_transaction
    DROP CONSTRAINT ledger_transaction_reversal_fk,
    DROP CONSTRAINT ledger_transaction_wallet_fk,
    DROP CONSTRAINT ledger_transaction_txn_wallet_key,
    ADD CONSTRAINT ledger_transaction_txn_wallet_unit_key UNIQUE (ledger_txn_id, tenant_id, wallet_id, unit_code),
    ADD CONSTRAINT ledger_transaction_txn_xact_key UNIQUE (ledger_txn_id, tenant_id, wallet_id, unit_code, created_xid),
    ADD CONSTRAINT ledger_transaction_wallet_fk FOREIGN KEY (tenant_id, wallet_id, unit_code)
        REFERENCES wallet_account (tenant_id, wallet_id, unit_code) DEFERRABLE INITIALLY DEFERRED,
    ADD CONSTRAINT ledger_transaction_reversal_fk FOREIGN KEY (reversal_of, tenant_id, wallet_id, unit_code)
        REFERENCES ledger_transaction (ledger_txn_id, tenant_id, wallet_id, unit_code) DEFERRABLE INITIALLY DEFERRED;
ALTER TABLE ledger_entry ADD CONSTRAINT ledger_entry_txn_fk
    FOREIGN KEY (ledger_txn_id, tenant_id, wallet_id, unit_code, created_xid)
    REFERENCES ledger_transaction (ledger_txn_id, tenant_id, wallet_id, unit_code, created_xid) DEFERRABLE INITIALLY DEFERRED;
-- A header's tenant and unit default from its wallet, an entry's wallet, tenant and unit from its
-- header, as before (the writers of this project pass them all).
CREATE FUNCTION ledger_transaction_defaults() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.tenant_id IS NULL OR NEW.unit_code IS NULL THEN
        SELECT coalesce(NEW.tenant_id, w.tenant_id), coalesce(NEW.unit_code, w.unit_code)
          INTO NEW.tenant_id, NEW.unit_code
          FROM wallet_account w WHERE w.wallet_id = NEW.wallet_id;
    END IF;
    RETURN NEW;
END;
$$;
DROP TRIGGER ledger_transaction_fill_tenant ON ledger_transaction;
CREATE TRIGGER ledger_transaction_defaults BEFORE INSERT ON ledger_transaction
    FOR EACH ROW EXECUTE FUNCTION ledger_transaction_defaults();
CREATE OR REPLACE FUNCTION ledger_entry_defaults() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.wallet_id IS NULL OR NEW.tenant_id IS NULL OR NEW.unit_code IS NULL THEN
        SELECT coalesce(NEW.wallet_id, t.wallet_id), coalesce(NEW.tenant_id, t.tenant_id), coalesce(NEW.unit_code, t.unit_code)
          INTO NEW.wallet_id, NEW.tenant_id, NEW.unit_code
          FROM ledger_transaction t WHERE t.ledger_txn_id = NEW.ledger_txn_id;
    END IF;
    RETURN NEW;
END;
$$;
-- An idempotency record names its tenant by the key of every query that reads it; its foreign key
-- checked that tenant on every admission. Tenants are never deleted, a record is written only for
-- the authenticated caller's tenant, and the admission that completes it inserts the task, whose
-- (tenant, user) key checks the tenant in the same transaction.
ALTER TABLE idempotency_record DROP CONSTRAINT idempotency_record_tenant_id_fkey;
-- Two of credit_lot's checks follow from the others: remaining + reserved <= original with both
-- parts never negative (their domains) keeps each part within the original.
ALTER TABLE credit_lot DROP CONSTRAINT credit_lot_remaining_le_original, DROP CONSTRAINT credit_lot_reserved_le_original;

-- 4. 0190's arithmetic, as one SQL expression (the caller's plan inlines it).
CREATE OR REPLACE FUNCTION aivedio_expected_wait(
    p_queued_units bigint, p_active_weight bigint, p_mu double precision, p_tenant_weight bigint,
    p_tenant_units bigint, p_tenant_active boolean, p_units bigint) RETURNS double precision
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN p_mu <= 0 THEN 'Infinity'::double precision
                ELSE greatest(0.0, least(p_queued_units / p_mu,
                                         (p_tenant_units + p_units)
                                         / (p_mu * CASE WHEN p_active_weight + CASE WHEN p_tenant_active THEN 0 ELSE p_tenant_weight END > 0
                                                        THEN p_tenant_weight::double precision
                                                             / (p_active_weight + CASE WHEN p_tenant_active THEN 0 ELSE p_tenant_weight END)
                                                        ELSE 1.0 END)
                                         - p_units / p_mu))
           END
$$;

-- 5. A tenant's queue counts in a bounded number of rows (many users behind one tenant). The checks
-- read the tenant's queued tasks and units as the sum of task_queue_usage (0190), a row per user and
-- lane: a tenant of two thousand users summed two thousand rows on every admission, under the
-- wallet's lock. The user's own limits need the user's rows only; the tenant's limits now read
-- tenant_queue_usage, the same counts per lane in at most 64 rows (a user's tasks count in the shard
-- its id hashes to), kept by the same trigger in the same transaction, so both stay exact. Shards,
-- not one row per tenant and lane: a partitioned wallet's admissions run side by side (0195's slots),
-- and one row that each of them updated would make them wait for each other's commits again; with
-- a power of two of up to 64 slots, a slot's users are a shard's (slot and shard take the same
-- hash). The checks read the sum of the shards, so a shard's own count may be anything.
-- (No task changes state while the counts are copied and the trigger switched: section 1's ALTER
-- holds generation_task's lock until commit.)

CREATE TABLE tenant_queue_usage (
    tenant_id    uuid     NOT NULL,
    queue_class  text     NOT NULL,
    shard        smallint NOT NULL CHECK (shard >= 0),
    queued_tasks bigint   NOT NULL DEFAULT 0,
    queued_units bigint   NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, queue_class, shard)
);

-- The shard of a user's tasks, of 64.
CREATE FUNCTION aivedio_queue_shard(p_user uuid) RETURNS smallint
LANGUAGE sql IMMUTABLE AS $$ SELECT (hashtext(p_user::text) & 63)::smallint $$;

INSERT INTO tenant_queue_usage (tenant_id, queue_class, shard, queued_tasks, queued_units)
SELECT tenant_id, queue_class, aivedio_queue_shard(user_id), sum(queued_tasks), sum(queued_units)
  FROM task_queue_usage GROUP BY 1, 2, 3;

-- 0190's trigger function, moving both counts in one statement per side of the change.
CREATE OR REPLACE FUNCTION aivedio_task_queue_usage() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' AND OLD.state = 'QUEUED' THEN
        WITH per_user AS (
            INSERT INTO task_queue_usage AS u (tenant_id, user_id, queue_class, queued_tasks, queued_units)
            VALUES (OLD.tenant_id, OLD.user_id, OLD.queue_class, -1, -OLD.fairness_units)
            ON CONFLICT (tenant_id, user_id, queue_class) DO UPDATE
               SET queued_tasks = u.queued_tasks - 1, queued_units = u.queued_units - OLD.fairness_units)
        INSERT INTO tenant_queue_usage AS s (tenant_id, queue_class, shard, queued_tasks, queued_units)
        VALUES (OLD.tenant_id, OLD.queue_class, aivedio_queue_shard(OLD.user_id), -1, -OLD.fairness_units)
        ON CONFLICT (tenant_id, queue_class, shard) DO UPDATE
           SET queued_tasks = s.queued_tasks - 1, queued_units = s.queued_units - OLD.fairness_units;
    END IF;
    IF TG_OP <> 'DELETE' AND NEW.state = 'QUEUED' THEN
        WITH per_user AS (
            INSERT INTO task_queue_usage AS u (tenant_id, user_id, queue_class, queued_tasks, queued_units)
            VALUES (NEW.tenant_id, NEW.user_id, NEW.queue_class, 1, NEW.fairness_units)
            ON CONFLICT (tenant_id, user_id, queue_class) DO UPDATE
               SET queued_tasks = u.queued_tasks + 1, queued_units = u.queued_units + NEW.fairness_units)
        INSERT INTO tenant_queue_usage AS s (tenant_id, queue_class, shard, queued_tasks, queued_units)
        VALUES (NEW.tenant_id, NEW.queue_class, aivedio_queue_shard(NEW.user_id), 1, NEW.fairness_units)
        ON CONFLICT (tenant_id, queue_class, shard) DO UPDATE
           SET queued_tasks = s.queued_tasks + 1, queued_units = s.queued_units + NEW.fairness_units;
    END IF;
    RETURN NULL;
END;
$$;

-- 6. A POSTPAID wallet can be partitioned too (an enterprise's contract wallet is the hot one): it
-- has no credit lots, so its slots' allowances are of no lot (lot_id null), carved from its credit
-- line within the credit limit and the period's contract budget. One allowance row per wallet, slot
-- and lot still, a null lot being one lot: the primary key names the lot by lot_key, the lot or the
-- nil uuid (a key column cannot be null, and logical replication needs a key).
ALTER TABLE wallet_allowance
    DROP CONSTRAINT wallet_allowance_pkey,
    ALTER COLUMN lot_id DROP NOT NULL,
    ADD COLUMN lot_key uuid GENERATED ALWAYS AS (coalesce(lot_id, '00000000-0000-0000-0000-000000000000')) STORED,
    ADD PRIMARY KEY (wallet_id, slot, lot_key);

-- 7. 0195's function, in fewer statements: the same parameters, answers, checks, locks and writes,
-- but that a slot short of a task answers SLOT_SHORT for the merged path (a second call, the refill's
-- only), and that a POSTPAID wallet can be partitioned.
DROP FUNCTION aivedio_admit;
CREATE FUNCTION aivedio_admit(
    p_tenant uuid, p_user uuid, p_task uuid, p_key text, p_hash text, p_claimed boolean,
    p_now timestamptz, p_now_iso text, p_record_expires timestamptz,
    p_queue_class text, p_band smallint, p_resource_class text, p_model text, p_units bigint,
    p_slot_units bigint, p_cost_units bigint, p_gpu_units bigint, p_media_units bigint, p_mode text,
    p_prompt text, p_duration integer, p_resolution text, p_with_audio boolean, p_interactive boolean,
    p_inputs jsonb, p_params jsonb, p_expensive boolean, p_estimate_version bigint, p_project text,
    p_policy_version bigint, p_weight bigint, p_max_user_tasks bigint, p_max_user_units bigint,
    p_max_tasks bigint, p_max_units bigint, p_max_cost_minute bigint, p_max_cost_day bigint,
    p_max_wait double precision,
    p_minute_start timestamptz, p_day_start timestamptz,
    p_lane_units bigint, p_lane_weight bigint, p_lane_mu double precision,
    p_be_allowed boolean, p_be_units bigint, p_be_weight bigint, p_be_mu double precision, p_be_max_units bigint,
    p_price_version uuid, p_quoted bigint, p_amount bigint, p_charge_policy text, p_unit text,
    p_event_id uuid, p_merged boolean,
    OUT status text, OUT detail text, OUT body text, OUT decision text, OUT queue_class text,
    OUT wait_seconds double precision, OUT amount bigint,
    OUT rec_hash text, OUT rec_status text, OUT rec_response_status integer, OUT rec_body text,
    OUT path text)
-- Every read here is by key. On the small, hot tables (a wallet row per tenant, a lot per wallet,
-- updated by every admission) the planner prefers a sequential scan, which reads every dead row
-- version the admissions left since the last vacuum; an index scan reads the one row's chain. The
-- foreign keys' checks are planned here too: SET CONSTRAINTS below makes them run in this function.
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    w wallet_account%ROWTYPE;
    v_part wallet_partitioning%ROWTYPE;
    v_rec idempotency_record%ROWTYPE;
    v_rec_found boolean := false;
    v_slot integer := 0;
    v_slots bigint := 1;  -- admissions of the tenant that may be in flight at once beside this one's view
    v_user_tasks bigint;
    v_user_units bigint;
    v_tasks bigint;
    v_units bigint;
    v_lane_units bigint;
    v_spent_minute bigint;
    v_spent_day bigint;
    v_band smallint := p_band;
    v_room bigint;
    v_need bigint;
    v_part_amount bigint;
    v_have bigint;
    v_others bigint;
    v_credit_room bigint;
    v_slot_lots uuid[];
    v_slot_amounts bigint[];
    i integer;
    v_lot record;
    v_lots uuid[] := '{}';
    v_parts bigint[] := '{}';
    v_carve_lots uuid[] := '{}';
    v_carve_parts bigint[] := '{}';
    v_reservation uuid := gen_random_uuid();
    v_txn uuid := gen_random_uuid();
    v_max_wait_secs constant double precision := 315360000;  -- ten years: the estimated start's cap
BEGIN
    -- The deferred foreign keys checked at the end of each statement, inside this function (and with
    -- its plans), not at commit: every parent is written before or with its children here. The call
    -- is its transaction (aivedio.admission.write), so nothing else is checked earlier for it.
    IF pg_current_xact_id_if_assigned() IS NOT NULL THEN
        RAISE EXCEPTION 'aivedio_admit runs alone in its transaction' USING ERRCODE = 'P0001',
            DETAIL = 'it sets the deferred constraints immediate for the rest of the transaction';
    END IF;
    SET CONSTRAINTS ALL IMMEDIATE;
    decision := 'ACCEPTED';
    queue_class := p_queue_class;
    path := 'WALLET';

    -- 1. The locks. The tenant's wallet (the first by id) is locked by the statement that finds it,
    -- FOR NO KEY UPDATE (billing.ledger.lock_wallet says why), unless it is partitioned: then the
    -- slot path takes its slot's allowance rows only, when the slot looks able to pay, and the
    -- merged path every slot's rows and then the wallet, in the lock order of everything that locks
    -- both (0195 says why).
    SELECT a.* INTO w FROM wallet_account a
     WHERE a.wallet_id = (SELECT f.wallet_id FROM wallet_account f WHERE f.tenant_id = p_tenant ORDER BY f.wallet_id LIMIT 1)
       AND NOT EXISTS (SELECT 1 FROM wallet_partitioning p WHERE p.wallet_id = a.wallet_id)
       FOR NO KEY UPDATE OF a;
    IF NOT FOUND THEN  -- no wallet, or a partitioned one
        SELECT a.wallet_id, a.account_type, a.frozen, a.freeze_reason, a.available_amount, a.reserved_amount,
               a.credit_limit_amount, a.unit_code, p.wallet_id, p.slots, p.chunk_amount, p.fast_max_units,
               p.fast_max_cost_units
          INTO w.wallet_id, w.account_type, w.frozen, w.freeze_reason, w.available_amount, w.reserved_amount,
               w.credit_limit_amount, w.unit_code, v_part.wallet_id, v_part.slots, v_part.chunk_amount,
               v_part.fast_max_units, v_part.fast_max_cost_units
          FROM wallet_account a LEFT JOIN wallet_partitioning p USING (wallet_id)
         WHERE a.tenant_id = p_tenant ORDER BY a.wallet_id LIMIT 1;
        IF w.wallet_id IS NOT NULL THEN
            IF v_part.wallet_id IS NULL THEN
                -- Unpartitioned since the first read: locked as it is now.
                SELECT * INTO w FROM wallet_account WHERE wallet_id = w.wallet_id FOR NO KEY UPDATE;
            ELSE
                v_slot := (hashtext(p_user::text)::bigint & 2147483647) % v_part.slots;
                v_slots := v_part.slots;
                path := 'MERGED';
                -- The slot path: the slot's rows locked, in lot order, and what they hold read by the
                -- same statement (its lots in spending order, for the draw). A slot short of the task
                -- answers SLOT_SHORT, and the caller asks again for the merged path, which refills it.
                -- (A free task takes the merged path: a slot admission must hold its slot's rows, which
                -- bounds how many are in flight, and a slot that holds nothing has none.)
                IF NOT p_merged AND NOT w.frozen AND p_amount > 0 AND p_units <= v_part.fast_max_units
                   AND p_cost_units <= v_part.fast_max_cost_units THEN
                    SELECT coalesce(sum(a.amount) FILTER (WHERE l.expires_at IS NULL OR l.expires_at > p_now), 0),
                           coalesce(array_agg(a.lot_id ORDER BY l.expires_at ASC NULLS LAST, l.priority ASC, l.created_at ASC,
                                                            a.lot_id)
                                        FILTER (WHERE a.amount > 0 AND (l.expires_at IS NULL OR l.expires_at > p_now)), '{}'),
                           coalesce(array_agg(a.amount ORDER BY l.expires_at ASC NULLS LAST, l.priority ASC, l.created_at ASC,
                                                            a.lot_id)
                                        FILTER (WHERE a.amount > 0 AND (l.expires_at IS NULL OR l.expires_at > p_now)), '{}')
                      INTO v_have, v_slot_lots, v_slot_amounts
                      FROM (SELECT s.lot_id, s.amount FROM wallet_allowance s
                             WHERE s.wallet_id = w.wallet_id AND s.slot = v_slot ORDER BY s.lot_id FOR UPDATE) a
                      LEFT JOIN credit_lot l USING (lot_id);  -- a POSTPAID wallet's allowance is of no lot
                    IF v_have < p_amount THEN
                        status := 'SLOT_SHORT';
                        RETURN;
                    END IF;
                    path := 'SLOT';
                ELSE
                    PERFORM 1 FROM wallet_allowance a WHERE a.wallet_id = w.wallet_id ORDER BY a.slot, a.lot_id FOR UPDATE;
                    SELECT * INTO w FROM wallet_account WHERE wallet_id = w.wallet_id FOR NO KEY UPDATE;
                    -- And the rows a refill added while this one waited (their slots' admissions do not wait for us).
                    PERFORM 1 FROM wallet_allowance a WHERE a.wallet_id = w.wallet_id ORDER BY a.slot, a.lot_id FOR UPDATE;
                END IF;
            END IF;
        END IF;
    END IF;

    -- 2. The idempotency record (a request that claimed its key must still own its IN_PROGRESS
    -- record, read FOR UPDATE), with the queue usage and the cost windows the checks read.
    IF p_claimed THEN
        SELECT * INTO v_rec FROM idempotency_record WHERE tenant_id = p_tenant AND idempotency_key = p_key FOR UPDATE;
        IF NOT FOUND OR v_rec.status <> 'IN_PROGRESS' OR v_rec.task_id IS DISTINCT FROM p_task THEN
            IF FOUND AND v_rec.status = 'COMPLETED' THEN
                status := 'RECORD';
                rec_hash := v_rec.request_hash; rec_status := v_rec.status;
                rec_response_status := v_rec.response_status; rec_body := v_rec.response_body;
            ELSE
                status := 'IN_PROGRESS';
            END IF;
            RETURN;
        END IF;
    END IF;
    SELECT r.tenant_id IS NOT NULL, r.status, r.expires_at, r.locked_until, r.request_hash, r.response_status,
           r.response_body, u.user_tasks, u.user_units, t.tasks, t.units, t.lane_units, c.minute, c.day
      INTO v_rec_found, v_rec.status, v_rec.expires_at, v_rec.locked_until, v_rec.request_hash, v_rec.response_status,
           v_rec.response_body, v_user_tasks, v_user_units, v_tasks, v_units, v_lane_units, v_spent_minute, v_spent_day
      FROM (SELECT coalesce(sum(q.queued_tasks), 0) AS user_tasks, coalesce(sum(q.queued_units), 0) AS user_units
              FROM task_queue_usage q WHERE q.tenant_id = p_tenant AND q.user_id = p_user) u
     CROSS JOIN (SELECT coalesce(sum(g.queued_tasks), 0) AS tasks, coalesce(sum(g.queued_units), 0) AS units,
                        coalesce(sum(g.queued_units) FILTER (WHERE g.queue_class = p_queue_class), 0) AS lane_units
                   FROM tenant_queue_usage g WHERE g.tenant_id = p_tenant) t
     CROSS JOIN (SELECT coalesce(sum(k.cost_units) FILTER (WHERE k.window_kind = 'MINUTE'), 0) AS minute,
                        coalesce(sum(k.cost_units) FILTER (WHERE k.window_kind = 'DAY'), 0) AS day
                   FROM tenant_cost_window k
                  WHERE k.tenant_id = p_tenant
                    AND ((k.window_kind = 'MINUTE' AND k.window_start = p_minute_start)
                         OR (k.window_kind = 'DAY' AND k.window_start = p_day_start))) c
      LEFT JOIN idempotency_record r ON NOT p_claimed AND r.tenant_id = p_tenant AND r.idempotency_key = p_key;
    IF v_rec_found AND v_rec.expires_at > p_now
       AND (v_rec.status = 'COMPLETED' OR (v_rec.locked_until IS NOT NULL AND v_rec.locked_until > p_now)) THEN
        status := 'RECORD';
        rec_hash := v_rec.request_hash; rec_status := v_rec.status;
        rec_response_status := v_rec.response_status; rec_body := v_rec.response_body;
        RETURN;
    END IF;

    -- 3. The checks: the first refusal leaves the block with its status set. On the slot path, a
    -- tenant-wide limit the slots could pass together sends the admission to the merged path.
    <<checks>>
    BEGIN
        IF w.wallet_id IS NULL THEN
            status := 'NO_WALLET';
            EXIT checks;
        END IF;
        IF w.frozen THEN
            status := 'WALLET_FROZEN';
            detail := w.freeze_reason;
            EXIT checks;
        END IF;
        IF v_user_tasks + 1 > p_max_user_tasks OR v_user_units + p_units > p_max_user_units THEN
            status := 'USER_QUEUE_FULL';
            EXIT checks;
        END IF;
        IF v_tasks + 1 > p_max_tasks OR v_units + p_units > p_max_units THEN
            status := 'TENANT_QUEUE_FULL';
            EXIT checks;
        END IF;
        IF path = 'SLOT' AND (v_tasks + v_slots > p_max_tasks OR v_units + v_slots * v_part.fast_max_units > p_max_units) THEN
            status := 'SLOT_SHORT';
            EXIT checks;
        END IF;
        IF v_spent_minute + p_cost_units > p_max_cost_minute THEN
            status := 'COST_MINUTE';
            EXIT checks;
        END IF;
        IF v_spent_day + p_cost_units > p_max_cost_day THEN
            status := 'COST_DAY';
            EXIT checks;
        END IF;
        IF path = 'SLOT' AND (v_spent_minute + v_slots * v_part.fast_max_cost_units > p_max_cost_minute
                              OR v_spent_day + v_slots * v_part.fast_max_cost_units > p_max_cost_day) THEN
            status := 'SLOT_SHORT';
            EXIT checks;
        END IF;

        wait_seconds := aivedio_expected_wait(p_lane_units, p_lane_weight, p_lane_mu, p_weight, v_lane_units,
                                              v_lane_units > 0, p_units);
        IF wait_seconds > p_max_wait THEN
            IF p_be_allowed AND p_be_units + p_units <= p_be_max_units THEN
                decision := 'ACCEPTED_BEST_EFFORT';
                queue_class := 'BEST_EFFORT';
                v_band := 4;
                wait_seconds := aivedio_expected_wait(p_be_units, p_be_weight, p_be_mu, p_weight, 0, false, p_units);
            ELSE
                status := 'WAIT_TOO_LONG';
                EXIT checks;
            END IF;
        END IF;

        IF path = 'WALLET' THEN
            -- billing.reservations.can_reserve: the balance, or a POSTPAID wallet's credit limit.
            IF (w.account_type = 'POSTPAID' AND w.available_amount - p_amount < -w.credit_limit_amount)
               OR (w.account_type <> 'POSTPAID' AND w.available_amount < p_amount) THEN
                status := 'INSUFFICIENT_CREDIT';
                amount := w.available_amount;
                EXIT checks;
            END IF;
            IF w.account_type = 'POSTPAID' THEN
                SELECT b.budget_amount - (b.settled_amount - b.refunded_amount) - w.reserved_amount INTO v_room
                  FROM (SELECT * FROM contract_budget cb WHERE cb.wallet_id = w.wallet_id AND cb.period_start <= p_now
                         ORDER BY cb.period_start DESC LIMIT 1) b
                 WHERE b.period_end > p_now;
                IF v_room IS NOT NULL AND p_amount > v_room THEN
                    status := 'CONTRACT_BUDGET';
                    amount := v_room;
                    EXIT checks;
                END IF;
            ELSIF p_amount > 0 THEN
                v_need := p_amount;
                FOR v_lot IN SELECT l.lot_id, l.remaining_amount FROM credit_lot l
                              WHERE l.wallet_id = w.wallet_id AND l.remaining_amount > 0
                                AND (l.expires_at IS NULL OR l.expires_at > p_now)
                              ORDER BY l.expires_at ASC NULLS LAST, l.priority ASC, l.created_at ASC, l.lot_id
                                FOR NO KEY UPDATE LOOP
                    v_part_amount := least(v_need, v_lot.remaining_amount);
                    v_lots := v_lots || v_lot.lot_id;
                    v_parts := v_parts || v_part_amount;
                    v_need := v_need - v_part_amount;
                    EXIT WHEN v_need = 0;
                END LOOP;
                IF v_need > 0 THEN
                    status := 'LOTS_EXHAUSTED';
                    detail := format('wallet %s: lots hold %s of the %s available', w.wallet_id, p_amount - v_need, p_amount);
                    EXIT checks;
                END IF;
            END IF;
        ELSIF p_amount > 0 AND path = 'MERGED' THEN
            -- The merged path. Refill the slot: from the wallet (a chunk, at least what is missing),
            -- then from the other slots' allowances. Everything is locked; nothing is written yet.
            -- A wallet with lots carves from them, earliest expiry first; a POSTPAID wallet carves
            -- from its credit line, within its credit limit and the period's contract budget (its
            -- allowances count as reserved in both), as an allowance of no lot.
            SELECT coalesce(sum(a.amount), 0) INTO v_have
              FROM wallet_allowance a LEFT JOIN credit_lot l USING (lot_id)
             WHERE a.wallet_id = w.wallet_id AND a.slot = v_slot AND (l.expires_at IS NULL OR l.expires_at > p_now);
            IF v_have < p_amount THEN
                IF w.account_type = 'POSTPAID' THEN
                    v_credit_room := w.available_amount + w.credit_limit_amount;
                    SELECT b.budget_amount - (b.settled_amount - b.refunded_amount) - w.reserved_amount INTO v_room
                      FROM (SELECT * FROM contract_budget cb WHERE cb.wallet_id = w.wallet_id AND cb.period_start <= p_now
                             ORDER BY cb.period_start DESC LIMIT 1) b
                     WHERE b.period_end > p_now;
                    v_part_amount := least(greatest(p_amount - v_have, v_part.chunk_amount),
                                           greatest(0, least(v_credit_room, coalesce(v_room, v_credit_room))));
                    IF v_part_amount > 0 THEN
                        v_carve_lots := ARRAY[NULL::uuid];
                        v_carve_parts := ARRAY[v_part_amount];
                        v_have := v_have + v_part_amount;
                    END IF;
                ELSE
                    v_need := greatest(p_amount - v_have, least(v_part.chunk_amount, w.available_amount));
                    FOR v_lot IN SELECT l.lot_id, l.remaining_amount FROM credit_lot l
                                  WHERE l.wallet_id = w.wallet_id AND l.remaining_amount > 0
                                    AND (l.expires_at IS NULL OR l.expires_at > p_now)
                                  ORDER BY l.expires_at ASC NULLS LAST, l.priority ASC, l.created_at ASC, l.lot_id
                                    FOR NO KEY UPDATE LOOP  -- as the wallet: slot admissions' keys pass
                        EXIT WHEN v_need = 0;
                        v_part_amount := least(v_need, v_lot.remaining_amount);
                        v_carve_lots := v_carve_lots || v_lot.lot_id;
                        v_carve_parts := v_carve_parts || v_part_amount;
                        v_need := v_need - v_part_amount;
                        v_have := v_have + v_part_amount;
                    END LOOP;
                END IF;
                IF v_have < p_amount THEN
                    -- What the other slots hold counts too: exactly the wallet's credit is spendable.
                    v_others := (SELECT coalesce(sum(a.amount), 0) FROM wallet_allowance a LEFT JOIN credit_lot l USING (lot_id)
                                  WHERE a.wallet_id = w.wallet_id AND a.slot <> v_slot
                                    AND (l.expires_at IS NULL OR l.expires_at > p_now));
                    IF v_have + v_others < p_amount THEN
                        IF v_room IS NOT NULL AND v_room < v_credit_room THEN  -- POSTPAID: the budget binds
                            status := 'CONTRACT_BUDGET';
                            amount := v_room + (SELECT coalesce(sum(a.amount), 0) FROM wallet_allowance a
                                                 WHERE a.wallet_id = w.wallet_id);
                        ELSE
                            status := 'INSUFFICIENT_CREDIT';
                            amount := w.available_amount + (SELECT coalesce(sum(a.amount), 0) FROM wallet_allowance a
                                                              WHERE a.wallet_id = w.wallet_id);
                        END IF;
                        EXIT checks;
                    END IF;
                END IF;
            END IF;
        END IF;
    END;
    IF status IS NOT NULL THEN
        IF status <> 'SLOT_SHORT' AND NOT p_claimed
           AND EXISTS (SELECT 1 FROM generation_task t WHERE t.tenant_id = p_tenant AND t.idempotency_key = p_key) THEN
            status := 'KEY_SPENT';
            detail := NULL;
            amount := NULL;
        END IF;
        RETURN;
    END IF;

    -- 4. The writes. The answer first: it is what the idempotency record stores.
    body := format('{"task_id": %s, "state": "QUEUED", "decision": %s, "queue_class": %s, "estimated_start_at": %s, '
                   '"queue_position_level": %s, "quote": {"price_version_id": %s, "quoted_amount": %s, '
                   '"max_reserve_amount": %s, "unit": %s}}',
                   to_json(p_task::text), to_json(decision), to_json(queue_class),
                   to_json(to_char((p_now + make_interval(secs => least(wait_seconds, v_max_wait_secs))) AT TIME ZONE 'UTC',
                                   'YYYY-MM-DD"T"HH24:MI:SS"Z"')),
                   to_json(CASE WHEN wait_seconds < 0.25 * p_max_wait THEN 'LOW'
                                WHEN wait_seconds < 0.75 * p_max_wait THEN 'MEDIUM' ELSE 'HIGH' END),
                   to_json(p_price_version::text), p_quoted, p_amount, to_json(p_unit));
    IF p_claimed THEN
        UPDATE idempotency_record r
           SET status = 'COMPLETED', response_status = 202, response_body = body, expires_at = p_record_expires,
               locked_until = NULL
         WHERE r.tenant_id = p_tenant AND r.idempotency_key = p_key;
    ELSE
        INSERT INTO idempotency_record AS r (tenant_id, idempotency_key, request_hash, status, response_status,
                                             response_body, task_id, created_at, expires_at, locked_until)
        VALUES (p_tenant, p_key, p_hash, 'COMPLETED', 202, body, p_task, p_now, p_record_expires, NULL)
        ON CONFLICT (tenant_id, idempotency_key) DO UPDATE
           SET request_hash = excluded.request_hash, status = 'COMPLETED', response_status = 202,
               response_body = excluded.response_body, task_id = excluded.task_id, created_at = excluded.created_at,
               expires_at = excluded.expires_at, locked_until = NULL
         WHERE r.expires_at <= p_now
            OR (r.status = 'IN_PROGRESS' AND coalesce(r.locked_until, '-infinity') <= p_now);
        IF NOT FOUND THEN
            SELECT * INTO v_rec FROM idempotency_record WHERE tenant_id = p_tenant AND idempotency_key = p_key;
            status := 'RECORD';
            body := NULL;
            rec_hash := v_rec.request_hash; rec_status := v_rec.status;
            rec_response_status := v_rec.response_status; rec_body := v_rec.response_body;
            RETURN;
        END IF;
    END IF;

    IF path = 'MERGED' AND p_amount > 0 THEN
        -- The refill: a RESERVE of the wallet for the slot (AVAILABLE -> RESERVED per lot), then
        -- what is still missing moved from the other slots (the credit stays RESERVED in its lots).
        IF cardinality(v_carve_lots) > 0 THEN
            WITH carve AS (
                INSERT INTO ledger_transaction (ledger_txn_id, tenant_id, wallet_id, unit_code, business_key, event_type,
                                                reason_code, metadata)
                VALUES (v_txn, p_tenant, w.wallet_id, w.unit_code, 'allowance:carve:' || gen_random_uuid()::text, 'RESERVE',
                        'ALLOWANCE', jsonb_build_object('slot', v_slot))),
            carve_entries AS (
                INSERT INTO ledger_entry (ledger_txn_id, tenant_id, wallet_id, lot_id, bucket, amount_delta, unit_code)
                SELECT v_txn, p_tenant, w.wallet_id, u.lot_id, b.bucket, b.sign * u.part, w.unit_code
                  FROM unnest(v_carve_lots, v_carve_parts) AS u(lot_id, part),
                       (VALUES ('AVAILABLE', -1), ('RESERVED', 1)) AS b(bucket, sign)),
            carve_lots AS (
                UPDATE credit_lot l
                   SET remaining_amount = l.remaining_amount - u.part, reserved_amount = l.reserved_amount + u.part
                  FROM unnest(v_carve_lots, v_carve_parts) AS u(lot_id, part)
                 WHERE l.lot_id = u.lot_id),
            carve_wallet AS (
                UPDATE wallet_account a
                   SET available_amount = a.available_amount - (SELECT sum(x) FROM unnest(v_carve_parts) x),
                       reserved_amount = a.reserved_amount + (SELECT sum(x) FROM unnest(v_carve_parts) x),
                       version = a.version + 1, updated_at = now()
                 WHERE a.wallet_id = w.wallet_id)
            INSERT INTO wallet_allowance AS a (wallet_id, slot, lot_id, tenant_id, amount)
            SELECT w.wallet_id, v_slot, u.lot_id, p_tenant, u.part FROM unnest(v_carve_lots, v_carve_parts) AS u(lot_id, part)
            ON CONFLICT (wallet_id, slot, lot_key) DO UPDATE SET amount = a.amount + excluded.amount;
            v_txn := gen_random_uuid();
        END IF;
        v_need := p_amount - (SELECT coalesce(sum(a.amount), 0) FROM wallet_allowance a LEFT JOIN credit_lot l USING (lot_id)
                               WHERE a.wallet_id = w.wallet_id AND a.slot = v_slot
                                 AND (l.expires_at IS NULL OR l.expires_at > p_now));
        IF v_need > 0 THEN
            FOR v_lot IN SELECT a.slot, a.lot_id, a.amount FROM wallet_allowance a LEFT JOIN credit_lot l USING (lot_id)
                          WHERE a.wallet_id = w.wallet_id AND a.slot <> v_slot AND a.amount > 0
                            AND (l.expires_at IS NULL OR l.expires_at > p_now)
                          ORDER BY l.expires_at ASC NULLS LAST, l.priority ASC, l.created_at ASC, a.lot_id, a.slot LOOP
                EXIT WHEN v_need = 0;
                v_part_amount := least(v_need, v_lot.amount);
                UPDATE wallet_allowance a SET amount = a.amount - v_part_amount
                 WHERE a.wallet_id = w.wallet_id AND a.slot = v_lot.slot AND a.lot_id IS NOT DISTINCT FROM v_lot.lot_id;
                INSERT INTO wallet_allowance AS a (wallet_id, slot, lot_id, tenant_id, amount)
                VALUES (w.wallet_id, v_slot, v_lot.lot_id, p_tenant, v_part_amount)
                ON CONFLICT (wallet_id, slot, lot_key) DO UPDATE SET amount = a.amount + excluded.amount;
                v_need := v_need - v_part_amount;
            END LOOP;
        END IF;
    END IF;
    IF path <> 'WALLET' AND p_amount > 0 THEN
        -- Draw the task's credit from the slot's allowance, lots in spending order: on the slot path
        -- as its locking read found them, on the merged path as its refill left them.
        IF path = 'MERGED' THEN
            SELECT coalesce(array_agg(a.lot_id ORDER BY l.expires_at ASC NULLS LAST, l.priority ASC, l.created_at ASC, a.lot_id), '{}'),
                   coalesce(array_agg(a.amount ORDER BY l.expires_at ASC NULLS LAST, l.priority ASC, l.created_at ASC, a.lot_id), '{}')
              INTO v_slot_lots, v_slot_amounts
              FROM wallet_allowance a LEFT JOIN credit_lot l USING (lot_id)
             WHERE a.wallet_id = w.wallet_id AND a.slot = v_slot AND a.amount > 0
               AND (l.expires_at IS NULL OR l.expires_at > p_now);
        END IF;
        v_need := p_amount;
        FOR i IN 1 .. cardinality(v_slot_lots) LOOP
            EXIT WHEN v_need = 0;
            v_part_amount := least(v_need, v_slot_amounts[i]);
            v_lots := v_lots || v_slot_lots[i];
            v_parts := v_parts || v_part_amount;
            v_need := v_need - v_part_amount;
        END LOOP;
        IF v_need > 0 THEN
            -- The merged path's refill left the slot short (it refilled what was missing: a bug).
            RAISE EXCEPTION 'aivedio_slot_short' USING ERRCODE = 'P0001', DETAIL = 'the slot''s allowance is short';
        END IF;
        UPDATE wallet_allowance a SET amount = a.amount - u.part
          FROM unnest(v_lots, v_parts) AS u(lot_id, part)
         WHERE a.wallet_id = w.wallet_id AND a.slot = v_slot AND a.lot_id IS NOT DISTINCT FROM u.lot_id;
    END IF;

    -- Everything else in one statement. Through the wallet: the lots' remaining -> reserved, the
    -- RESERVE's entries AVAILABLE -> RESERVED per lot (one pair without lots: POSTPAID) and the
    -- snapshot. Through a slot: from its allowance to the task's reservation, RESERVED -> RESERVED of
    -- each lot, so neither the lots nor the snapshot change. A free task reserves nothing.
    WITH task AS (
        INSERT INTO generation_task
            (task_id, tenant_id, user_id, queue_class, priority_band, base_priority_band, resource_class, state, model_code,
             fairness_units, provider_slot_units, estimated_cost_units, enqueue_at, next_eligible_at, policy_version,
             estimate_version, idempotency_key, created_at, updated_at, mode, prompt, duration_seconds, resolution,
             with_audio, interactive, inputs, normalized_params, gpu_units, media_units, admission_decision, project_id)
        VALUES (p_task, p_tenant, p_user, queue_class, v_band, v_band, p_resource_class, 'QUEUED', p_model,
                p_units, p_slot_units, p_cost_units, p_now, p_now, p_policy_version,
                p_estimate_version, p_key, p_now, p_now, p_mode, p_prompt, p_duration, p_resolution,
                p_with_audio, p_interactive, p_inputs, p_params, p_gpu_units, p_media_units, decision, p_project)),
    lots AS (
        UPDATE credit_lot l
           SET remaining_amount = l.remaining_amount - u.part, reserved_amount = l.reserved_amount + u.part
          FROM unnest(v_lots, v_parts) AS u(lot_id, part)
         WHERE path = 'WALLET' AND l.lot_id = u.lot_id),
    reservation AS (
        INSERT INTO credit_reservation (reservation_id, tenant_id, wallet_id, task_id, quoted_amount, reserved_amount, state,
                                        price_version_id, charge_policy_code)
        VALUES (v_reservation, p_tenant, w.wallet_id, p_task, p_quoted, p_amount, 'ACTIVE', p_price_version, p_charge_policy)),
    allocations AS (
        INSERT INTO reservation_allocation (reservation_id, lot_id, tenant_id, amount)
        SELECT v_reservation, u.lot_id, p_tenant, u.part FROM unnest(v_lots, v_parts) AS u(lot_id, part)
         WHERE u.lot_id IS NOT NULL),  -- (a POSTPAID slot's credit is of no lot)
    txn AS (
        INSERT INTO ledger_transaction (ledger_txn_id, tenant_id, wallet_id, unit_code, business_key, event_type, task_id,
                                        reservation_id, reason_code)
        SELECT v_txn, p_tenant, w.wallet_id, w.unit_code, 'reserve:generation:' || p_task::text || ':v1', 'RESERVE', p_task,
               v_reservation, CASE WHEN path = 'WALLET' THEN NULL ELSE 'FROM_ALLOWANCE' END
         WHERE p_amount > 0),
    entries AS (
        INSERT INTO ledger_entry (ledger_txn_id, tenant_id, wallet_id, lot_id, bucket, amount_delta, unit_code)
        SELECT v_txn, p_tenant, w.wallet_id, u.lot_id,
               CASE WHEN b.sign < 0 AND path = 'WALLET' THEN 'AVAILABLE' ELSE 'RESERVED' END, b.sign * u.part, w.unit_code
          FROM (SELECT * FROM unnest(v_lots, v_parts)
                UNION ALL
                SELECT NULL::uuid, p_amount WHERE cardinality(v_lots) = 0) AS u(lot_id, part),
               (VALUES (-1), (1)) AS b(sign)
         WHERE p_amount > 0),
    snapshot AS (
        UPDATE wallet_account a
           SET available_amount = a.available_amount - p_amount, reserved_amount = a.reserved_amount + p_amount,
               version = a.version + 1, updated_at = now()
         WHERE path = 'WALLET' AND p_amount > 0 AND a.wallet_id = w.wallet_id),
    charge AS (
        INSERT INTO generation_charge (task_id, tenant_id, price_version_id, normalized_params, quoted_amount,
                                       max_reserve_amount, charge_policy_code)
        VALUES (p_task, p_tenant, p_price_version, p_params, p_quoted, p_amount, p_charge_policy)),
    windows AS (
        INSERT INTO tenant_cost_window AS c (tenant_id, window_kind, window_start, slot, cost_units)
        VALUES (p_tenant, 'MINUTE', p_minute_start, v_slot, p_cost_units), (p_tenant, 'DAY', p_day_start, v_slot, p_cost_units)
        ON CONFLICT (tenant_id, window_kind, window_start, slot) DO UPDATE SET cost_units = c.cost_units + excluded.cost_units)
    INSERT INTO outbox_event (event_id, event_type, aggregate_type, aggregate_id, tenant_id, payload)
    VALUES (p_event_id, 'TaskQueued', 'generation_task', p_task, p_tenant,
            jsonb_build_object('task_id', p_task::text, 'tenant_id', p_tenant::text, 'queue_class', queue_class,
                               'priority_band', v_band, 'fairness_units', p_units, 'enqueue_at', p_now_iso));
    status := 'ADMITTED';
END;
$$;
