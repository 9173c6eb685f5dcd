-- 0050: the atomic claim of ch. 18.10 as one server-side function, so a claim is one round trip
-- instead of fifteen (the CAS, one conditional increment per resource key, the attempt, the
-- reservations and the outbox row were each a statement). aivedio.scheduling.claim calls it and
-- documents it; the steps and the lock order are the same as before:
--   1. CAS the task QUEUED -> DISPATCHING (the task row is the first lock);
--   2. a conditional increment per resource key, keys in sorted order (the caller sorts), on the
--      preferred shard, then on any shard with room;
--   3. the task_attempt with the fencing token drawn in step 1, its resource_reservation rows, and
--      the TaskDispatchRequested outbox row (the columns aivedio.outbox.write_event writes).
-- A key without room rolls every step back (the block below is a subtransaction) and answers
-- status NO_ROOM with the key in detail; a task that moved answers NO_ROOM / task:moved.
CREATE FUNCTION aivedio_claim(
    p_task uuid, p_tenant uuid, p_version bigint, p_attempt uuid,
    p_provider text, p_account text, p_region text, p_model text, p_mode text,
    p_cost numeric, p_currency text, p_lease timestamptz, p_now timestamptz,
    p_keys text[], p_units bigint[], p_shards integer[], p_prefer bigint,
    p_event_id uuid, p_payload jsonb,
    OUT status text, OUT detail text, OUT fencing bigint, OUT task_version bigint)
LANGUAGE plpgsql AS $$
DECLARE
    i integer;
    v_shard integer;
    v_taken integer[] := '{}';
BEGIN
    BEGIN
        UPDATE generation_task t
           SET state = 'DISPATCHING', version = t.version + 1, updated_at = p_now, current_attempt_id = p_attempt,
               current_fencing_token = nextval('fencing_token_seq'), selected_provider = p_provider,
               selected_account = p_account, capacity_mode = p_mode
         WHERE t.task_id = p_task AND t.tenant_id = p_tenant AND t.state = 'QUEUED' AND t.version = p_version
        RETURNING t.current_fencing_token, t.version INTO fencing, task_version;
        IF NOT FOUND THEN
            status := 'NO_ROOM';
            detail := 'task:moved';
            RETURN;
        END IF;
        FOR i IN 1 .. coalesce(array_length(p_keys, 1), 0) LOOP
            v_shard := NULL;
            UPDATE resource_pool_shard s SET used_units = s.used_units + p_units[i], version = s.version + 1
             WHERE s.resource_key = p_keys[i] AND s.shard_no = (p_prefer % p_shards[i])::integer
               AND s.used_units + p_units[i] <= least(s.capacity_units, coalesce(s.limit_units, s.capacity_units))
            RETURNING s.shard_no INTO v_shard;
            IF v_shard IS NULL AND p_shards[i] > 1 THEN
                UPDATE resource_pool_shard s SET used_units = s.used_units + p_units[i], version = s.version + 1
                 WHERE s.resource_key = p_keys[i] AND s.shard_no = (
                       SELECT o.shard_no FROM resource_pool_shard o
                        WHERE o.resource_key = p_keys[i] AND o.shard_no <> (p_prefer % p_shards[i])::integer
                          AND o.used_units + p_units[i] <= least(o.capacity_units, coalesce(o.limit_units, o.capacity_units))
                        ORDER BY o.used_units LIMIT 1 FOR UPDATE SKIP LOCKED)
                   AND s.used_units + p_units[i] <= least(s.capacity_units, coalesce(s.limit_units, s.capacity_units))
                RETURNING s.shard_no INTO v_shard;
            END IF;
            IF v_shard IS NULL THEN
                RAISE EXCEPTION 'aivedio_no_room' USING DETAIL = p_keys[i];
            END IF;
            v_taken := v_taken || v_shard;
        END LOOP;
        INSERT INTO task_attempt (attempt_id, task_id, tenant_id, attempt_no, provider, provider_account, region,
                                  model_code, provider_request_key, state, fencing_token, estimated_cost_amount,
                                  estimated_cost_currency, capacity_mode, lease_until, created_at, updated_at)
        SELECT p_attempt, p_task, p_tenant, coalesce(max(a.attempt_no), 0) + 1, p_provider, p_account, p_region, p_model,
               p_task::text || ':' || (coalesce(max(a.attempt_no), 0) + 1)::text, 'DISPATCHING', fencing, p_cost,
               p_currency, p_mode, p_lease, p_now, p_now
          FROM task_attempt a WHERE a.task_id = p_task;
        INSERT INTO resource_reservation (task_id, attempt_id, tenant_id, resource_key, shard_no, reserved_units, state,
                                          lease_until, fencing_token, capacity_mode, created_at)
        SELECT p_task, p_attempt, p_tenant, x.k, x.s, x.u, 'ACTIVE', p_lease, fencing, p_mode, p_now
          FROM unnest(p_keys, v_taken, p_units) AS x(k, s, u);
        INSERT INTO outbox_event (event_id, event_type, aggregate_type, aggregate_id, tenant_id, payload)
        VALUES (p_event_id, 'TaskDispatchRequested', 'generation_task', p_task, p_tenant,
                p_payload || jsonb_build_object('fencing_token', fencing, 'aggregate_version', task_version));
        status := 'OK';
    EXCEPTION WHEN raise_exception THEN
        IF SQLERRM <> 'aivedio_no_room' THEN
            RAISE;
        END IF;
        GET STACKED DIAGNOSTICS detail = PG_EXCEPTION_DETAIL;
        status := 'NO_ROOM';
        fencing := NULL;
        task_version := NULL;
    END;
END;
$$;
