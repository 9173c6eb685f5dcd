-- 0160: the last good policy set (aivedio.policy.tenant_policy, issue 16; ch. 18.18, 18.19.4).
--
-- Every accepted policy change (validated as a whole before it commits) appends the whole set in
-- force after it: each tenant's policy with its policy_version. The newest row is the last good
-- set, the one to fall back to or restore from when the live rows cannot be trusted. Append-only
-- like the audit log: a snapshot is evidence, never edited.
CREATE TABLE policy_set_snapshot (
    snapshot_id    bigserial PRIMARY KEY,
    taken_at       timestamptz NOT NULL DEFAULT now(),
    operator       text NOT NULL,
    reason         text,
    -- the change that made this set: its tenant and the version it brought into force
    tenant_id      uuid,
    policy_version bigint,
    -- {"<tenant_id>": {<every column but tenant_id>, "policy_version": n, ...}, ...}
    policies       jsonb NOT NULL CONSTRAINT policy_set_snapshot_object CHECK (jsonb_typeof(policies) = 'object'),
    tenant_count   integer NOT NULL CHECK (tenant_count >= 0)
);
CREATE INDEX idx_policy_set_snapshot_taken ON policy_set_snapshot (taken_at DESC);

CREATE TRIGGER policy_set_snapshot_append_only BEFORE UPDATE OR DELETE ON policy_set_snapshot
    FOR EACH ROW EXECUTE FUNCTION aivedio_forbid_mutation();
CREATE TRIGGER policy_set_snapshot_no_truncate BEFORE TRUNCATE ON policy_set_snapshot
    FOR EACH STATEMENT EXECUTE FUNCTION aivedio_forbid_mutation();

