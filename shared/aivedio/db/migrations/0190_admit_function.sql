-- 0190: admission's write path (ch. 18.11, 20.6.2) as one server-side function, so an admission is
-- one round trip instead of sixteen, and the wallet's row lock is held for the function's own work
-- and its commit only, never across network round trips. aivedio.admission.write calls it and
-- documents it; its checks and writes are the ones admission made from Python before:
--   1. lock the tenant's wallet (the first wallet by id, as ledger.lock_wallet does): it serialises
--      the tenant's admissions, so the counts below are exact;
--   2. the idempotency record: a record that still holds the key answers (status RECORD); a
--      request that claimed its key before probing its inputs (p_claimed) must still own its
--      IN_PROGRESS record; a key whose task exists is spent (the task's unique key refuses it);
--   3. the checks, in today's order, each answering with its code and writing nothing: no wallet,
--      frozen wallet, the user's and the tenant's queue limits (from task_queue_usage), the minute
--      and day cost windows,
--      the expected wait (with the downgrade to BEST_EFFORT), the credit (balance, or POSTPAID credit
--      limit and contract budget of the period), and the credit lots, earliest expiry first;
--   4. the writes: the COMPLETED idempotency record (first, so a concurrent request with the same
--      key that completed meanwhile answers instead, with nothing else written), the task, the lots'
--      remaining -> reserved, the credit reservation and its allocations, the RESERVE ledger
--      transaction with its entries and the wallet snapshot, the charge snapshot, the cost windows,
--      and the TaskQueued outbox row (the columns aivedio.outbox.write_event writes).
-- The function only reads and locks before step 4, so a rejection leaves nothing and needs no
-- subtransaction; called alone in autocommit, the statement is the whole transaction.

-- What the queue limits count, kept per (tenant, user, lane) by a trigger on every way a task
-- enters or leaves QUEUED (admission, claim, cancel, requeue), in the same transaction: the
-- admission reads a tenant's few usage rows under the wallet lock instead of counting its queued
-- tasks, whose number grows with the queue (a big tenant's queue is deep). Exact: every change of a
-- task's state, lane, units or user moves the counters by the same amount, and a row a decrement
-- would miss is created with the negative amount, so each tenant's sums always equal its QUEUED
-- tasks (a test compares them).
CREATE TABLE task_queue_usage (
    tenant_id    uuid   NOT NULL,
    user_id      uuid   NOT NULL,
    queue_class  text   NOT NULL,
    queued_tasks bigint NOT NULL DEFAULT 0,
    queued_units bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, user_id, queue_class)
);

CREATE FUNCTION aivedio_task_queue_usage() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' AND OLD.state = 'QUEUED' THEN
        INSERT INTO task_queue_usage AS u (tenant_id, user_id, queue_class, queued_tasks, queued_units)
        VALUES (OLD.tenant_id, OLD.user_id, OLD.queue_class, -1, -OLD.fairness_units)
        ON CONFLICT (tenant_id, user_id, queue_class) DO UPDATE
           SET queued_tasks = u.queued_tasks - 1, queued_units = u.queued_units - OLD.fairness_units;
    END IF;
    IF TG_OP <> 'DELETE' AND NEW.state = 'QUEUED' THEN
        INSERT INTO task_queue_usage AS u (tenant_id, user_id, queue_class, queued_tasks, queued_units)
        VALUES (NEW.tenant_id, NEW.user_id, NEW.queue_class, 1, NEW.fairness_units)
        ON CONFLICT (tenant_id, user_id, queue_class) DO UPDATE
           SET queued_tasks = u.queued_tasks + 1, queued_units = u.queued_units + NEW.fairness_units;
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER generation_task_queue_usage_insert AFTER INSERT ON generation_task
    FOR EACH ROW WHEN (NEW.state = 'QUEUED') EXECUTE FUNCTION aivedio_task_queue_usage();
CREATE TRIGGER generation_task_queue_usage_update AFTER UPDATE ON generation_task
    FOR EACH ROW WHEN ((OLD.state = 'QUEUED' OR NEW.state = 'QUEUED')
                       AND (OLD.state, OLD.tenant_id, OLD.user_id, OLD.queue_class, OLD.fairness_units)
                           IS DISTINCT FROM (NEW.state, NEW.tenant_id, NEW.user_id, NEW.queue_class, NEW.fairness_units))
    EXECUTE FUNCTION aivedio_task_queue_usage();
CREATE TRIGGER generation_task_queue_usage_delete AFTER DELETE ON generation_task
    FOR EACH ROW WHEN (OLD.state = 'QUEUED') EXECUTE FUNCTION aivedio_task_queue_usage();
-- The tasks queued before this migration (the trigger holds generation_task's lock until commit).
INSERT INTO task_queue_usage (tenant_id, user_id, queue_class, queued_tasks, queued_units)
SELECT tenant_id, user_id, queue_class, count(*), coalesce(sum(fairness_units), 0)
  FROM generation_task WHERE state = 'QUEUED' GROUP BY tenant_id, user_id, queue_class;

-- Every admission and settlement moves a lot's remaining_amount. The expiry sweep's index of 0030
-- named remaining_amount in its predicate, which made each of those updates a non-HOT one: a new
-- entry in every index of credit_lot per admission, so a wallet's busy lot bloated its primary key
-- between vacuums and each lookup of it got slower. The same index without remaining_amount serves
-- the sweep (billing.expiry filters remaining_amount > 0 on the heap) and lets the updates be HOT.
DROP INDEX idx_credit_lot_expiring;
CREATE INDEX idx_credit_lot_expiring ON credit_lot (expires_at) WHERE expires_at IS NOT NULL;

-- aivedio.scheduling.queue_stats.expected_wait_seconds, the same arithmetic (a unit test compares
-- them): real seconds until a task of `units` could start, the lesser of the whole lane ahead at mu
-- and the tenant's own queue at its weighted DRR share of mu.
CREATE FUNCTION aivedio_expected_wait(
    p_queued_units bigint, p_active_weight bigint, p_mu double precision, p_tenant_weight bigint,
    p_tenant_units bigint, p_tenant_active boolean, p_units bigint) RETURNS double precision
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_total double precision;
    v_share double precision;
BEGIN
    IF p_mu <= 0 THEN
        RETURN 'Infinity'::double precision;
    END IF;
    v_total := p_active_weight + CASE WHEN p_tenant_active THEN 0 ELSE p_tenant_weight END;
    v_share := CASE WHEN v_total > 0 THEN p_tenant_weight / v_total ELSE 1.0 END;
    RETURN greatest(0.0, least(p_queued_units / p_mu,
                               (p_tenant_units + p_units) / (p_mu * v_share) - p_units / p_mu));
END;
$$;

CREATE FUNCTION aivedio_admit(
    -- the request: who, its task id (the idempotency token), its key and body hash
    p_tenant uuid, p_user uuid, p_task uuid, p_key text, p_hash text, p_claimed boolean,
    p_now timestamptz, p_now_iso text, p_record_expires timestamptz,
    -- the task, as estimated
    p_queue_class text, p_band smallint, p_resource_class text, p_model text, p_units bigint,
    p_slot_units bigint, p_cost_units bigint, p_gpu_units bigint, p_media_units bigint, p_mode text,
    p_prompt text, p_duration integer, p_resolution text, p_with_audio boolean, p_interactive boolean,
    p_inputs jsonb, p_params jsonb, p_expensive boolean, p_estimate_version bigint, p_project text,
    -- the tenant's policy, as admission loaded it (max_wait in real seconds)
    p_policy_version bigint, p_weight bigint, p_max_user_tasks bigint, p_max_user_units bigint,
    p_max_tasks bigint, p_max_units bigint, p_max_cost_minute bigint, p_max_cost_day bigint,
    p_max_wait double precision,
    -- the cost windows' starts
    p_minute_start timestamptz, p_day_start timestamptz,
    -- lane figures (admission's per-process cache); BEST_EFFORT's when a downgrade is allowed
    p_lane_units bigint, p_lane_weight bigint, p_lane_mu double precision,
    p_be_allowed boolean, p_be_units bigint, p_be_weight bigint, p_be_mu double precision, p_be_max_units bigint,
    -- the quote
    p_price_version uuid, p_quoted bigint, p_amount bigint, p_charge_policy text, p_unit text,
    p_event_id uuid,
    OUT status text, OUT detail text, OUT body text, OUT decision text, OUT queue_class text,
    OUT wait_seconds double precision, OUT amount bigint,
    OUT rec_hash text, OUT rec_status text, OUT rec_response_status integer, OUT rec_body text)
LANGUAGE plpgsql AS $$
DECLARE
    w wallet_account%ROWTYPE;
    v_rec idempotency_record%ROWTYPE;
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
    v_part bigint;
    v_lot record;
    v_lots uuid[] := '{}';
    v_parts bigint[] := '{}';
    v_reservation uuid := gen_random_uuid();
    v_txn uuid := gen_random_uuid();
    i integer;
    v_max_wait_secs constant double precision := 315360000;  -- ten years: the estimated start's cap
BEGIN
    decision := 'ACCEPTED';
    queue_class := p_queue_class;

    -- 1. The wallet lock.
    SELECT * INTO w FROM wallet_account WHERE tenant_id = p_tenant ORDER BY wallet_id LIMIT 1 FOR UPDATE;

    -- 2. The idempotency record.
    IF p_claimed THEN
        SELECT * INTO v_rec FROM idempotency_record WHERE tenant_id = p_tenant AND idempotency_key = p_key FOR UPDATE;
        IF NOT FOUND OR v_rec.status <> 'IN_PROGRESS' OR v_rec.task_id IS DISTINCT FROM p_task THEN
            -- This request outlived its lock and another took the key over: that one answers.
            IF FOUND AND v_rec.status = 'COMPLETED' THEN
                status := 'RECORD';
                rec_hash := v_rec.request_hash; rec_status := v_rec.status;
                rec_response_status := v_rec.response_status; rec_body := v_rec.response_body;
            ELSE
                status := 'IN_PROGRESS';
            END IF;
            RETURN;
        END IF;
    ELSE
        SELECT * INTO v_rec FROM idempotency_record WHERE tenant_id = p_tenant AND idempotency_key = p_key;
        IF FOUND AND v_rec.expires_at > p_now
           AND (v_rec.status = 'COMPLETED' OR (v_rec.locked_until IS NOT NULL AND v_rec.locked_until > p_now)) THEN
            status := 'RECORD';
            rec_hash := v_rec.request_hash; rec_status := v_rec.status;
            rec_response_status := v_rec.response_status; rec_body := v_rec.response_body;
            RETURN;
        END IF;
    END IF;

    -- 3. The checks: the first refusal leaves the block with its status set.
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

        SELECT coalesce(sum(u.queued_tasks) FILTER (WHERE u.user_id = p_user), 0),
               coalesce(sum(u.queued_units) FILTER (WHERE u.user_id = p_user), 0),
               coalesce(sum(u.queued_tasks), 0), coalesce(sum(u.queued_units), 0),
               coalesce(sum(u.queued_units) FILTER (WHERE u.queue_class = p_queue_class), 0)
          INTO v_user_tasks, v_user_units, v_tasks, v_units, v_lane_units
          FROM task_queue_usage u WHERE u.tenant_id = p_tenant;
        IF v_user_tasks + 1 > p_max_user_tasks OR v_user_units + p_units > p_max_user_units THEN
            status := 'USER_QUEUE_FULL';
            EXIT checks;
        END IF;
        IF v_tasks + 1 > p_max_tasks OR v_units + p_units > p_max_units THEN
            status := 'TENANT_QUEUE_FULL';
            EXIT checks;
        END IF;

        SELECT coalesce(max(c.cost_units) FILTER (WHERE c.window_kind = 'MINUTE'), 0),
               coalesce(max(c.cost_units) FILTER (WHERE c.window_kind = 'DAY'), 0)
          INTO v_spent_minute, v_spent_day
          FROM tenant_cost_window c
         WHERE c.tenant_id = p_tenant
           AND ((c.window_kind = 'MINUTE' AND c.window_start = p_minute_start)
                OR (c.window_kind = 'DAY' AND c.window_start = p_day_start));
        IF v_spent_minute + p_cost_units > p_max_cost_minute THEN
            status := 'COST_MINUTE';
            EXIT checks;
        END IF;
        IF v_spent_day + p_cost_units > p_max_cost_day THEN
            status := 'COST_DAY';
            EXIT checks;
        END IF;

        wait_seconds := aivedio_expected_wait(p_lane_units, p_lane_weight, p_lane_mu, p_weight, v_lane_units,
                                              v_lane_units > 0, p_units);
        IF wait_seconds > p_max_wait THEN
            -- Downgrade only into a BEST_EFFORT lane that is open to admission and has room.
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

        -- billing.reservations.can_reserve: the balance, or a POSTPAID wallet's credit limit.
        IF (w.account_type = 'POSTPAID' AND w.available_amount - p_amount < -w.credit_limit_amount)
           OR (w.account_type <> 'POSTPAID' AND w.available_amount < p_amount) THEN
            status := 'INSUFFICIENT_CREDIT';
            amount := w.available_amount;
            EXIT checks;
        END IF;
        IF w.account_type = 'POSTPAID' THEN
            -- The contract budget of the period in force (billing.contract_budgets.headroom).
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
            -- The lots, in billing.lots.SPENDING_ORDER, locked as they are taken.
            v_need := p_amount;
            FOR v_lot IN SELECT l.lot_id, l.remaining_amount FROM credit_lot l
                          WHERE l.wallet_id = w.wallet_id AND l.remaining_amount > 0
                            AND (l.expires_at IS NULL OR l.expires_at > p_now)
                          ORDER BY l.expires_at ASC NULLS LAST, l.priority ASC, l.created_at ASC, l.lot_id
                            FOR UPDATE LOOP
                v_part := least(v_need, v_lot.remaining_amount);
                v_lots := v_lots || v_lot.lot_id;
                v_parts := v_parts || v_part;
                v_need := v_need - v_part;
                EXIT WHEN v_need = 0;
            END LOOP;
            IF v_need > 0 THEN
                -- The snapshot still counts lots that expired and await their EXPIRE: not spendable credit.
                status := 'LOTS_EXHAUSTED';
                detail := format('wallet %s: lots hold %s of the %s available', w.wallet_id, p_amount - v_need, p_amount);
                EXIT checks;
            END IF;
        END IF;
    END;
    IF status IS NOT NULL THEN
        -- A key whose record expired (or was purged) while its task keeps it is spent, and that
        -- answers before any refusal, as the claim did. Looked up here, on refusals only: an
        -- admission meets generation_task_tenant_idempotency_key at the task's insert instead, and
        -- the whole call fails with nothing written (aivedio.admission.write: IDEMPOTENCY_KEY_REUSED).
        IF NOT p_claimed AND EXISTS (SELECT 1 FROM generation_task t
                                      WHERE t.tenant_id = p_tenant AND t.idempotency_key = p_key) THEN
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
            -- Another request with this key completed between the check above and here.
            SELECT * INTO v_rec FROM idempotency_record WHERE tenant_id = p_tenant AND idempotency_key = p_key;
            status := 'RECORD';
            body := NULL;
            rec_hash := v_rec.request_hash; rec_status := v_rec.status;
            rec_response_status := v_rec.response_status; rec_body := v_rec.response_body;
            RETURN;
        END IF;
    END IF;

    INSERT INTO generation_task
        (task_id, tenant_id, user_id, queue_class, priority_band, base_priority_band, resource_class, state, model_code,
         fairness_units, provider_slot_units, estimated_cost_units, enqueue_at, next_eligible_at, policy_version,
         estimate_version, idempotency_key, created_at, updated_at, mode, prompt, duration_seconds, resolution,
         with_audio, interactive, inputs, normalized_params, gpu_units, media_units, admission_decision, project_id)
    VALUES (p_task, p_tenant, p_user, queue_class, v_band, v_band, p_resource_class, 'QUEUED', p_model,
            p_units, p_slot_units, p_cost_units, p_now, p_now, p_policy_version,
            p_estimate_version, p_key, p_now, p_now, p_mode, p_prompt, p_duration, p_resolution,
            p_with_audio, p_interactive, p_inputs, p_params, p_gpu_units, p_media_units, decision, p_project);

    FOR i IN 1 .. cardinality(v_lots) LOOP  -- usually one lot: an update by its key
        UPDATE credit_lot l
           SET remaining_amount = l.remaining_amount - v_parts[i], reserved_amount = l.reserved_amount + v_parts[i]
         WHERE l.lot_id = v_lots[i];
    END LOOP;
    INSERT INTO credit_reservation (reservation_id, tenant_id, wallet_id, task_id, quoted_amount, reserved_amount, state,
                                    price_version_id, charge_policy_code)
    VALUES (v_reservation, p_tenant, w.wallet_id, p_task, p_quoted, p_amount, 'ACTIVE', p_price_version, p_charge_policy);
    IF cardinality(v_lots) > 0 THEN
        INSERT INTO reservation_allocation (reservation_id, lot_id, tenant_id, amount)
        SELECT v_reservation, u.lot_id, p_tenant, u.part FROM unnest(v_lots, v_parts) AS u(lot_id, part);
    END IF;
    IF p_amount > 0 THEN  -- a free task reserves nothing and posts nothing
        INSERT INTO ledger_transaction (ledger_txn_id, tenant_id, wallet_id, business_key, event_type, task_id,
                                        reservation_id)
        VALUES (v_txn, p_tenant, w.wallet_id, 'reserve:generation:' || p_task::text || ':v1', 'RESERVE', p_task,
                v_reservation);
        -- Double entries per lot (so each lot's movement is traceable), or one pair without lots.
        INSERT INTO ledger_entry (ledger_txn_id, tenant_id, wallet_id, lot_id, bucket, amount_delta, unit_code)
        SELECT v_txn, p_tenant, w.wallet_id, u.lot_id, b.bucket, b.sign * u.part, w.unit_code
          FROM (SELECT * FROM unnest(v_lots, v_parts)
                UNION ALL
                SELECT NULL::uuid, p_amount WHERE cardinality(v_lots) = 0) AS u(lot_id, part),
               (VALUES ('AVAILABLE', -1), ('RESERVED', 1)) AS b(bucket, sign);
        UPDATE wallet_account a
           SET available_amount = a.available_amount - p_amount, reserved_amount = a.reserved_amount + p_amount,
               version = a.version + 1, updated_at = now()
         WHERE a.wallet_id = w.wallet_id;
    END IF;

    INSERT INTO generation_charge (task_id, tenant_id, price_version_id, normalized_params, quoted_amount,
                                   max_reserve_amount, charge_policy_code)
    VALUES (p_task, p_tenant, p_price_version, p_params, p_quoted, p_amount, p_charge_policy);
    INSERT INTO tenant_cost_window AS c (tenant_id, window_kind, window_start, cost_units)
    VALUES (p_tenant, 'MINUTE', p_minute_start, p_cost_units), (p_tenant, 'DAY', p_day_start, p_cost_units)
    ON CONFLICT (tenant_id, window_kind, window_start) DO UPDATE SET cost_units = c.cost_units + excluded.cost_units;
    INSERT INTO outbox_event (event_id, event_type, aggregate_type, aggregate_id, tenant_id, payload)
    VALUES (p_event_id, 'TaskQueued', 'generation_task', p_task, p_tenant,
            jsonb_build_object('task_id', p_task::text, 'tenant_id', p_tenant::text, 'queue_class', queue_class,
                               'priority_band', v_band, 'fairness_units', p_units, 'enqueue_at', p_now_iso));
    status := 'ADMITTED';
END;
$$;
