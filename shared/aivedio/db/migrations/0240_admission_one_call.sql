-- 0240: admission in one round trip (issue 15, part 2). The caller no longer reads the tenant's
-- policy and the key's idempotency record before the call: the policy comes from a per-process cache
-- (aivedio.admission.service.tenant_policy), and aivedio_admit, which already answered a key's record
-- (RECORD) before any check, now also checks that the policy it was given is the one in force: a
-- policy whose version moved on (aivedio.policy.tenant_policy moves it with every change) answers
-- POLICY_STALE before any write, and the caller reloads the policy and decides again. Otherwise 0230's
-- function, unchanged: the same parameters, answers, locks, checks and writes.
CREATE OR REPLACE FUNCTION aivedio_admit(
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
    v_policy_version bigint;
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
           r.response_body, u.user_tasks, u.user_units, t.tasks, t.units, t.lane_units, c.minute, c.day,
           (SELECT s.policy_version FROM tenant_scheduling_policy s WHERE s.tenant_id = p_tenant)
      INTO v_rec_found, v_rec.status, v_rec.expires_at, v_rec.locked_until, v_rec.request_hash, v_rec.response_status,
           v_rec.response_body, v_user_tasks, v_user_units, v_tasks, v_units, v_lane_units, v_spent_minute, v_spent_day,
           v_policy_version
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
    -- The caller decided under p_policy_version (its policy is cached per process): a policy that has
    -- moved on since answers POLICY_STALE, having written nothing (the rows locked above are let go
    -- with the transaction), and the caller decides again.
    IF v_policy_version IS DISTINCT FROM p_policy_version THEN
        status := 'POLICY_STALE';
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
