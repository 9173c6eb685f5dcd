-- 0150: operator accounts with admin tokens (aivedio.admin.operators) and the chained audit log
-- (aivedio.audit, issue 16).

-- An API operator: one of the operator plane's roles and one admin token, stored as sha256 hex only.
CREATE TABLE operator_account (
    operator_id  uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name         text NOT NULL
        CONSTRAINT operator_account_name_unique UNIQUE
        CONSTRAINT operator_account_name_length CHECK (char_length(name) BETWEEN 1 AND 64),
    role         text NOT NULL
        CONSTRAINT operator_account_role_check CHECK (role IN ('viewer', 'operator', 'finance', 'admin')),
    token_hash   text NOT NULL
        CONSTRAINT operator_account_token_hash_unique UNIQUE
        CONSTRAINT operator_account_token_hash_hex CHECK (token_hash ~ '^[0-9a-f]{64}$'),
    token_prefix text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    created_by   text NOT NULL,
    rotated_at   timestamptz,
    revoked_at   timestamptz
);

-- The chain: each audit row carries the hash of its predecessor and its own hash over a canonical
-- text of its columns. jsonb's text form is canonical (sorted keys, normalised values) and the time
-- is epoch microseconds, so the hash does not depend on TimeZone or DateStyle.
ALTER TABLE audit_log ADD COLUMN prev_hash text, ADD COLUMN row_hash text;

CREATE FUNCTION aivedio_audit_row_hash(p_audit_id bigint, p_tenant_id uuid, p_operator text, p_action text,
                                       p_target text, p_old_value jsonb, p_new_value jsonb, p_reason text,
                                       p_policy_version bigint, p_created_at timestamptz, p_prev_hash text)
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT encode(sha256(convert_to(jsonb_build_object(
        'audit_id', p_audit_id, 'tenant_id', p_tenant_id, 'operator', p_operator, 'action', p_action,
        'target', p_target, 'old_value', p_old_value, 'new_value', p_new_value, 'reason', p_reason,
        'policy_version', p_policy_version,
        'created_at_us', (extract(epoch FROM p_created_at) * 1000000)::bigint,
        'prev_hash', p_prev_hash)::text, 'UTF8')), 'hex')
$$;

-- One row: the last link. Inserts lock it, so they serialise and each sees its predecessor.
CREATE TABLE audit_chain_head (
    singleton     boolean PRIMARY KEY DEFAULT true CONSTRAINT audit_chain_head_singleton CHECK (singleton),
    last_audit_id bigint,
    last_hash     text
);

-- The id is drawn under the head's lock, so audit_id order is the chain's order (and commit order):
-- a reader's snapshot always holds a prefix of the chain, and verify walks it by audit_id.
CREATE FUNCTION aivedio_audit_chain() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    head audit_chain_head%ROWTYPE;
BEGIN
    SELECT * INTO head FROM audit_chain_head FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'audit_chain_head is missing' USING ERRCODE = 'P0001';
    END IF;
    NEW.audit_id := nextval(pg_get_serial_sequence('audit_log', 'audit_id'));
    NEW.prev_hash := head.last_hash;
    NEW.row_hash := aivedio_audit_row_hash(NEW.audit_id, NEW.tenant_id, NEW.operator, NEW.action, NEW.target,
                                           NEW.old_value, NEW.new_value, NEW.reason, NEW.policy_version,
                                           NEW.created_at, NEW.prev_hash);
    UPDATE audit_chain_head SET last_audit_id = NEW.audit_id, last_hash = NEW.row_hash;
    RETURN NEW;
END
$$;

-- Backfill the rows that exist, in audit_id order (the append-only trigger is off for this alone).
ALTER TABLE audit_log DISABLE TRIGGER audit_log_append_only;
DO $$
DECLARE
    r record;
    h text := NULL;
    last_id bigint := NULL;
BEGIN
    FOR r IN SELECT * FROM audit_log ORDER BY audit_id LOOP
        UPDATE audit_log
           SET prev_hash = h,
               row_hash = aivedio_audit_row_hash(r.audit_id, r.tenant_id, r.operator, r.action, r.target, r.old_value,
                                                 r.new_value, r.reason, r.policy_version, r.created_at, h)
         WHERE audit_id = r.audit_id
        RETURNING row_hash INTO h;
        last_id := r.audit_id;
    END LOOP;
    INSERT INTO audit_chain_head (singleton, last_audit_id, last_hash) VALUES (true, last_id, h);
END
$$;
ALTER TABLE audit_log ENABLE TRIGGER audit_log_append_only;

-- The trigger draws the id; a column default would only burn a second value per row.
ALTER TABLE audit_log ALTER COLUMN audit_id DROP DEFAULT;
CREATE TRIGGER audit_log_chain BEFORE INSERT ON audit_log FOR EACH ROW EXECUTE FUNCTION aivedio_audit_chain();

-- The head is only ever updated by the chain trigger; it is never deleted or truncated.
CREATE TRIGGER audit_chain_head_no_delete BEFORE DELETE ON audit_chain_head
    FOR EACH ROW EXECUTE FUNCTION aivedio_forbid_mutation();
CREATE TRIGGER audit_chain_head_no_truncate BEFORE TRUNCATE ON audit_chain_head
    FOR EACH STATEMENT EXECUTE FUNCTION aivedio_forbid_mutation();
