-- The media bucket's storage as AWS bills it (aivedio.media.storage_cost): the Cost and Usage
-- Report's storage lines of the bucket, which AWS attributes by the bucket's tag
-- (aivedio:cost-scope = media-storage), never by an object's, so they name no tenant or task. Each
-- task's storage is booked by the platform itself (media_cost_event, kind STORAGE); these lines are
-- kept apart, so a cost report never counts the bucket twice, and checked each month against what
-- the platform expects. Append-only; source_key makes a re-import add nothing.
CREATE TABLE bucket_storage_cost (
    source_key   text PRIMARY KEY,
    usage_month  date NOT NULL CONSTRAINT bucket_storage_cost_month_check CHECK (usage_month = date_trunc('month', usage_month)),
    usage_type   text NOT NULL,
    amount       numeric(20, 8) NOT NULL,
    currency     text NOT NULL,
    line         jsonb NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idx_bucket_storage_cost_month ON bucket_storage_cost (usage_month);
CREATE TRIGGER bucket_storage_cost_append_only BEFORE UPDATE OR DELETE ON bucket_storage_cost
    FOR EACH ROW EXECUTE FUNCTION aivedio_forbid_mutation();
CREATE TRIGGER bucket_storage_cost_no_truncate BEFORE TRUNCATE ON bucket_storage_cost
    FOR EACH STATEMENT EXECUTE FUNCTION aivedio_forbid_mutation();

-- A month whose billed bucket storage strays from the platform's figure beyond the tolerance is
-- parked for finance, with both figures.
ALTER TABLE billing_parked_event DROP CONSTRAINT billing_parked_event_reason_check;
ALTER TABLE billing_parked_event ADD CONSTRAINT billing_parked_event_reason_check
    CHECK (reason IN ('UNKNOWN_TASK', 'TENANT_MISMATCH', 'MISSING_CHARGE', 'MALFORMED_EVENT', 'UNKNOWN_OUTCOME',
                      'CURRENCY_MISMATCH', 'CONFLICTING_TERMINAL', 'COST_WITHOUT_CHARGE_ID', 'COST_UNKNOWN',
                      'UNMAPPED_ATTEMPT', 'COST_MISMATCH', 'MEDIA_COST_UNATTRIBUTED', 'STORAGE_COST_MISMATCH'));
