-- 0195: hot wallets (ch. 20.11.4, "预先分配有限的 spend allowance 给多个调度分区，再定期归并"). A tenant whose many
-- users share one wallet locked that one row for every admission, and wrote the tenant's two cost
-- window rows too: its admissions ran one at a time whatever the machine. A partitioned wallet
-- (wallet_partitioning, opt-in per wallet, aivedio.billing.allowances) gives its admissions `slots`
-- partitions; a user's admissions always take the same slot (by a hash of the user id).
--
-- The money: an allowance is credit the wallet has already reserved for a slot, per credit lot
-- (wallet_allowance). Carving it is a RESERVE of the wallet (AVAILABLE -> RESERVED, reason
-- ALLOWANCE, the lots' remaining -> reserved, the snapshot moved) under the wallet lock; an
-- admission in the slot then moves its amount from the slot's allowance to its own reservation:
-- a RESERVE whose entries are RESERVED -x and RESERVED +x of the same lot, so neither the wallet
-- snapshot nor the lot changes and neither row is locked or written. The ledger stays the one
-- truth: every credit movement is in it, the snapshot equals it at every commit, and the wallet's
-- RESERVED is its open reservations plus its allowances (billing.wallet_checks counts both). The
-- allowance-return maintenance service (aivedio.reconcile.allowance_return) gives every allowance
-- back on a schedule (a RELEASE, RESERVED -> AVAILABLE, to the very lots), so none is stranded.
-- No oversell: a slot spends only what it holds, and whoever refills or rebalances holds the
-- wallet lock and every slot's lock.
--
-- The limits stay exact: a slot admission (the fast path) holds only its slot's rows, and at most
-- `slots` of them are in flight at once, so it admits only while the tenant's counts leave room
-- for `slots` admissions of at most fast_max_units units and fast_max_cost_units cost each (then
-- whatever they do together stays within the limit); otherwise, or when the slot's allowance is
-- short, the admission takes the merged path: the wallet lock and every slot's lock, the exact
-- checks of 0190, and a refill of its slot (from the wallet's lots, else from the other slots). A
-- user's limits are exact on either path (a user has one slot). The cost windows get a slot too,
-- so slots never write one row; the checks sum a tenant's rows.

CREATE TABLE wallet_partitioning (
    wallet_id           uuid    PRIMARY KEY REFERENCES wallet_account (wallet_id),
    tenant_id           uuid    NOT NULL,
    slots               integer NOT NULL CHECK (slots BETWEEN 2 AND 256),
    chunk_amount        bigint  NOT NULL CHECK (chunk_amount > 0),  -- what a refill carves for a slot
    fast_max_units      bigint  NOT NULL CHECK (fast_max_units > 0),
    fast_max_cost_units bigint  NOT NULL CHECK (fast_max_cost_units > 0),
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE wallet_allowance (
    wallet_id uuid    NOT NULL REFERENCES wallet_account (wallet_id),
    slot      integer NOT NULL CHECK (slot >= 0),
    lot_id    uuid    NOT NULL REFERENCES credit_lot (lot_id),
    tenant_id uuid    NOT NULL,
    amount    bigint  NOT NULL CHECK (amount >= 0),
    PRIMARY KEY (wallet_id, slot, lot_id)
);

-- A slot's cost window rows (slot 0 for a wallet that is not partitioned).
ALTER TABLE tenant_cost_window ADD COLUMN slot integer NOT NULL DEFAULT 0;
ALTER TABLE tenant_cost_window DROP CONSTRAINT tenant_cost_window_pkey;
ALTER TABLE tenant_cost_window ADD PRIMARY KEY (tenant_id, window_kind, window_start, slot);

DROP FUNCTION aivedio_admit;

-- 0190's function, with the slot path and the merged path of a partitioned wallet. p_merged asks
-- for the merged path: the caller retries with it when the slot path answered SLOT_SHORT.
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
LANGUAGE plpgsql AS $$
DECLARE
    w wallet_account%ROWTYPE;
    v_part wallet_partitioning%ROWTYPE;
    v_rec idempotency_record%ROWTYPE;
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
    v_lot record;
    v_lots uuid[] := '{}';
    v_parts bigint[] := '{}';
    v_carve_lots uuid[] := '{}';
    v_carve_parts bigint[] := '{}';
    v_reservation uuid := gen_random_uuid();
    v_txn uuid := gen_random_uuid();
    i integer;
    v_max_wait_secs constant double precision := 315360000;  -- ten years: the estimated start's cap
BEGIN
    decision := 'ACCEPTED';
    queue_class := p_queue_class;
    path := 'WALLET';

    -- 1. The locks. A partitioned wallet's slot path takes its slot's allowance rows only, when the
    -- slot looks able to pay. The merged path takes every slot's rows, then the wallet FOR NO KEY
    -- UPDATE: the lock order of everything that locks both (refills, returns, wallet checks) is the
    -- allowances first, and a slot admission's foreign keys take the wallet FOR KEY SHARE at commit,
    -- which NO KEY UPDATE lets through (FOR UPDATE would wait for it while it waits for the slot:
    -- a deadlock). NO KEY UPDATE still excludes every other balance change (they take it too,
    -- billing.ledger.lock_wallet, or update the row). An admission of a wallet that is not
    -- partitioned takes the wallet alone, FOR NO KEY UPDATE as well.
    SELECT * INTO w FROM wallet_account WHERE tenant_id = p_tenant ORDER BY wallet_id LIMIT 1;
    IF FOUND AND w.account_type <> 'POSTPAID' THEN
        SELECT * INTO v_part FROM wallet_partitioning WHERE wallet_id = w.wallet_id;
        IF FOUND THEN
            v_slot := (hashtext(p_user::text)::bigint & 2147483647) % v_part.slots;
            v_slots := v_part.slots;
            path := 'MERGED';
            -- (A free task takes the merged path: a slot admission must hold its slot's rows, which
            -- bounds how many are in flight, and a slot that holds nothing has none.)
            IF NOT p_merged AND NOT w.frozen AND p_amount > 0 AND p_units <= v_part.fast_max_units
               AND p_cost_units <= v_part.fast_max_cost_units
               AND (SELECT coalesce(sum(a.amount), 0) FROM wallet_allowance a JOIN credit_lot l USING (lot_id)
                     WHERE a.wallet_id = w.wallet_id AND a.slot = v_slot
                       AND (l.expires_at IS NULL OR l.expires_at > p_now)) >= p_amount THEN
                path := 'SLOT';
            END IF;
        END IF;
    END IF;
    IF path = 'SLOT' THEN
        PERFORM 1 FROM wallet_allowance a WHERE a.wallet_id = w.wallet_id AND a.slot = v_slot
          ORDER BY a.lot_id FOR UPDATE;
    ELSIF path = 'MERGED' THEN
        PERFORM 1 FROM wallet_allowance a WHERE a.wallet_id = w.wallet_id ORDER BY a.slot, a.lot_id FOR UPDATE;
        SELECT * INTO w FROM wallet_account WHERE wallet_id = w.wallet_id FOR NO KEY UPDATE;
        -- And the rows a refill added while this one waited (their slots' admissions do not wait for us).
        PERFORM 1 FROM wallet_allowance a WHERE a.wallet_id = w.wallet_id ORDER BY a.slot, a.lot_id FOR UPDATE;
    ELSE
        SELECT * INTO w FROM wallet_account WHERE tenant_id = p_tenant ORDER BY wallet_id LIMIT 1 FOR NO KEY UPDATE;
    END IF;

    -- 2. The idempotency record.
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
        IF path = 'SLOT' AND (v_tasks + v_slots > p_max_tasks OR v_units + v_slots * v_part.fast_max_units > p_max_units) THEN
            status := 'SLOT_SHORT';
            EXIT checks;
        END IF;

        SELECT coalesce(sum(c.cost_units) FILTER (WHERE c.window_kind = 'MINUTE'), 0),
               coalesce(sum(c.cost_units) FILTER (WHERE c.window_kind = 'DAY'), 0)
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
        ELSIF p_amount > 0 AND path = 'SLOT' THEN
            -- What the slot held when it was looked at may have been spent meanwhile.
            IF (SELECT coalesce(sum(a.amount), 0) FROM wallet_allowance a JOIN credit_lot l USING (lot_id)
                 WHERE a.wallet_id = w.wallet_id AND a.slot = v_slot
                   AND (l.expires_at IS NULL OR l.expires_at > p_now)) < p_amount THEN
                status := 'SLOT_SHORT';
                EXIT checks;
            END IF;
        ELSIF p_amount > 0 THEN
            IF path = 'MERGED' THEN
                -- Refill the slot: from the wallet's lots (a chunk, at least what is missing), then
                -- from the other slots' allowances. Everything is locked; nothing is written yet.
                SELECT coalesce(sum(a.amount), 0) INTO v_have
                  FROM wallet_allowance a JOIN credit_lot l USING (lot_id)
                 WHERE a.wallet_id = w.wallet_id AND a.slot = v_slot AND (l.expires_at IS NULL OR l.expires_at > p_now);
                IF v_have < p_amount THEN
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
                    IF v_have < p_amount THEN
                        -- What the other slots hold counts too: exactly the wallet's credit is spendable.
                        IF v_have + (SELECT coalesce(sum(a.amount), 0) FROM wallet_allowance a JOIN credit_lot l USING (lot_id)
                                      WHERE a.wallet_id = w.wallet_id AND a.slot <> v_slot
                                        AND (l.expires_at IS NULL OR l.expires_at > p_now)) < p_amount THEN
                            status := 'INSUFFICIENT_CREDIT';
                            amount := w.available_amount + (SELECT coalesce(sum(a.amount), 0) FROM wallet_allowance a
                                                              WHERE a.wallet_id = w.wallet_id);
                            EXIT checks;
                        END IF;
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

    INSERT INTO generation_task
        (task_id, tenant_id, user_id, queue_class, priority_band, base_priority_band, resource_class, state, model_code,
         fairness_units, provider_slot_units, estimated_cost_units, enqueue_at, next_eligible_at, policy_version,
         estimate_version, idempotency_key, created_at, updated_at, mode, prompt, duration_seconds, resolution,
         with_audio, interactive, inputs, normalized_params, gpu_units, media_units, admission_decision, project_id)
    VALUES (p_task, p_tenant, p_user, queue_class, v_band, v_band, p_resource_class, 'QUEUED', p_model,
            p_units, p_slot_units, p_cost_units, p_now, p_now, p_policy_version,
            p_estimate_version, p_key, p_now, p_now, p_mode, p_prompt, p_duration, p_resolution,
            p_with_audio, p_interactive, p_inputs, p_params, p_gpu_units, p_media_units, decision, p_project);

    IF path = 'MERGED' AND p_amount > 0 THEN
        -- The refill: a RESERVE of the wallet for the slot (AVAILABLE -> RESERVED per lot), then
        -- what is still missing moved from the other slots (the credit stays RESERVED in its lots).
        IF cardinality(v_carve_lots) > 0 THEN
            INSERT INTO ledger_transaction (ledger_txn_id, tenant_id, wallet_id, business_key, event_type, reason_code,
                                            metadata)
            VALUES (v_txn, p_tenant, w.wallet_id, 'allowance:carve:' || gen_random_uuid()::text, 'RESERVE', 'ALLOWANCE',
                    jsonb_build_object('slot', v_slot));
            INSERT INTO ledger_entry (ledger_txn_id, tenant_id, wallet_id, lot_id, bucket, amount_delta, unit_code)
            SELECT v_txn, p_tenant, w.wallet_id, u.lot_id, b.bucket, b.sign * u.part, w.unit_code
              FROM unnest(v_carve_lots, v_carve_parts) AS u(lot_id, part),
                   (VALUES ('AVAILABLE', -1), ('RESERVED', 1)) AS b(bucket, sign);
            FOR i IN 1 .. cardinality(v_carve_lots) LOOP
                UPDATE credit_lot l
                   SET remaining_amount = l.remaining_amount - v_carve_parts[i],
                       reserved_amount = l.reserved_amount + v_carve_parts[i]
                 WHERE l.lot_id = v_carve_lots[i];
            END LOOP;
            UPDATE wallet_account a
               SET available_amount = a.available_amount - (SELECT sum(x) FROM unnest(v_carve_parts) x),
                   reserved_amount = a.reserved_amount + (SELECT sum(x) FROM unnest(v_carve_parts) x),
                   version = a.version + 1, updated_at = now()
             WHERE a.wallet_id = w.wallet_id;
            INSERT INTO wallet_allowance AS a (wallet_id, slot, lot_id, tenant_id, amount)
            SELECT w.wallet_id, v_slot, u.lot_id, p_tenant, u.part FROM unnest(v_carve_lots, v_carve_parts) AS u(lot_id, part)
            ON CONFLICT (wallet_id, slot, lot_id) DO UPDATE SET amount = a.amount + excluded.amount;
            v_txn := gen_random_uuid();
        END IF;
        v_need := p_amount - (SELECT coalesce(sum(a.amount), 0) FROM wallet_allowance a JOIN credit_lot l USING (lot_id)
                               WHERE a.wallet_id = w.wallet_id AND a.slot = v_slot
                                 AND (l.expires_at IS NULL OR l.expires_at > p_now));
        IF v_need > 0 THEN
            FOR v_lot IN SELECT a.slot, a.lot_id, a.amount FROM wallet_allowance a JOIN credit_lot l USING (lot_id)
                          WHERE a.wallet_id = w.wallet_id AND a.slot <> v_slot AND a.amount > 0
                            AND (l.expires_at IS NULL OR l.expires_at > p_now)
                          ORDER BY l.expires_at ASC NULLS LAST, l.priority ASC, l.created_at ASC, a.lot_id, a.slot LOOP
                EXIT WHEN v_need = 0;
                v_part_amount := least(v_need, v_lot.amount);
                UPDATE wallet_allowance a SET amount = a.amount - v_part_amount
                 WHERE a.wallet_id = w.wallet_id AND a.slot = v_lot.slot AND a.lot_id = v_lot.lot_id;
                INSERT INTO wallet_allowance AS a (wallet_id, slot, lot_id, tenant_id, amount)
                VALUES (w.wallet_id, v_slot, v_lot.lot_id, p_tenant, v_part_amount)
                ON CONFLICT (wallet_id, slot, lot_id) DO UPDATE SET amount = a.amount + excluded.amount;
                v_need := v_need - v_part_amount;
            END LOOP;
        END IF;
    END IF;
    IF path <> 'WALLET' AND p_amount > 0 THEN
        -- Draw the task's credit from the slot's allowance, lots in spending order.
        v_need := p_amount;
        FOR v_lot IN SELECT a.lot_id, a.amount FROM wallet_allowance a JOIN credit_lot l USING (lot_id)
                      WHERE a.wallet_id = w.wallet_id AND a.slot = v_slot AND a.amount > 0
                        AND (l.expires_at IS NULL OR l.expires_at > p_now)
                      ORDER BY l.expires_at ASC NULLS LAST, l.priority ASC, l.created_at ASC, a.lot_id LOOP
            EXIT WHEN v_need = 0;
            v_part_amount := least(v_need, v_lot.amount);
            v_lots := v_lots || v_lot.lot_id;
            v_parts := v_parts || v_part_amount;
            v_need := v_need - v_part_amount;
        END LOOP;
        IF v_need > 0 THEN
            -- The slot looked able to pay and is not (a refill ran between the look and the lock).
            RAISE EXCEPTION 'aivedio_slot_short' USING ERRCODE = 'P0001', DETAIL = 'the slot''s allowance is short';
        END IF;
        FOR i IN 1 .. cardinality(v_lots) LOOP
            UPDATE wallet_allowance a SET amount = a.amount - v_parts[i]
             WHERE a.wallet_id = w.wallet_id AND a.slot = v_slot AND a.lot_id = v_lots[i];
        END LOOP;
    ELSE
        FOR i IN 1 .. cardinality(v_lots) LOOP
            UPDATE credit_lot l
               SET remaining_amount = l.remaining_amount - v_parts[i], reserved_amount = l.reserved_amount + v_parts[i]
             WHERE l.lot_id = v_lots[i];
        END LOOP;
    END IF;

    INSERT INTO credit_reservation (reservation_id, tenant_id, wallet_id, task_id, quoted_amount, reserved_amount, state,
                                    price_version_id, charge_policy_code)
    VALUES (v_reservation, p_tenant, w.wallet_id, p_task, p_quoted, p_amount, 'ACTIVE', p_price_version, p_charge_policy);
    IF cardinality(v_lots) > 0 THEN
        INSERT INTO reservation_allocation (reservation_id, lot_id, tenant_id, amount)
        SELECT v_reservation, u.lot_id, p_tenant, u.part FROM unnest(v_lots, v_parts) AS u(lot_id, part);
    END IF;
    IF p_amount > 0 THEN
        INSERT INTO ledger_transaction (ledger_txn_id, tenant_id, wallet_id, business_key, event_type, task_id,
                                        reservation_id, reason_code)
        VALUES (v_txn, p_tenant, w.wallet_id, 'reserve:generation:' || p_task::text || ':v1', 'RESERVE', p_task,
                v_reservation, CASE WHEN path = 'WALLET' THEN NULL ELSE 'FROM_ALLOWANCE' END);
        IF path = 'WALLET' THEN
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
        ELSE
            -- From the slot's allowance to the task's reservation: RESERVED to RESERVED of each lot, so
            -- the wallet's snapshot and its lots are as they were, and neither row is touched.
            INSERT INTO ledger_entry (ledger_txn_id, tenant_id, wallet_id, lot_id, bucket, amount_delta, unit_code)
            SELECT v_txn, p_tenant, w.wallet_id, u.lot_id, 'RESERVED', b.sign * u.part, w.unit_code
              FROM unnest(v_lots, v_parts) AS u(lot_id, part), (VALUES (-1), (1)) AS b(sign);
        END IF;
    END IF;

    INSERT INTO generation_charge (task_id, tenant_id, price_version_id, normalized_params, quoted_amount,
                                   max_reserve_amount, charge_policy_code)
    VALUES (p_task, p_tenant, p_price_version, p_params, p_quoted, p_amount, p_charge_policy);
    INSERT INTO tenant_cost_window AS c (tenant_id, window_kind, window_start, slot, cost_units)
    VALUES (p_tenant, 'MINUTE', p_minute_start, v_slot, p_cost_units), (p_tenant, 'DAY', p_day_start, v_slot, p_cost_units)
    ON CONFLICT (tenant_id, window_kind, window_start, slot) DO UPDATE SET cost_units = c.cost_units + excluded.cost_units;
    INSERT INTO outbox_event (event_id, event_type, aggregate_type, aggregate_id, tenant_id, payload)
    VALUES (p_event_id, 'TaskQueued', 'generation_task', p_task, p_tenant,
            jsonb_build_object('task_id', p_task::text, 'tenant_id', p_tenant::text, 'queue_class', queue_class,
                               'priority_band', v_band, 'fairness_units', p_units, 'enqueue_at', p_now_iso));
    status := 'ADMITTED';
END;
$$;
