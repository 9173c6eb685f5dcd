-- 0020: what the fair scheduler keeps in PostgreSQL.

-- An adaptive limit below capacity (AIMD after provider 429s, a tenant policy lowered while work
-- runs). Claims check used + demand <= least(capacity, limit); capacity stays >= used, so the
-- used_within_capacity CHECK keeps holding while running work drains.
ALTER TABLE resource_pool_shard ADD COLUMN limit_units bigint CHECK (limit_units >= 0);

-- DRR state per (lane, tenant), updated in the same transaction as the claims it pays for, so a
-- deficit can never drift from what was actually claimed. Redis holds only the ring of active
-- tenants; this table is the fact.
CREATE TABLE drr_lane_tenant (
    lane            text   NOT NULL,
    tenant_id       uuid   NOT NULL REFERENCES tenant (tenant_id),
    deficit         bigint NOT NULL DEFAULT 0 CHECK (deficit >= 0),
    fairness_debt   bigint NOT NULL DEFAULT 0 CHECK (fairness_debt >= 0),
    active          boolean NOT NULL DEFAULT true,
    served_units    bigint NOT NULL DEFAULT 0 CHECK (served_units >= 0),
    visits          bigint NOT NULL DEFAULT 0,
    last_active_at  timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (lane, tenant_id)
);

-- The PostgreSQL ring (conservative mode): the last tenant served per lane; the next is the
-- smallest tenant_id above it with queued work, found by one probe of idx_task_schedulable.
CREATE TABLE drr_lane_cursor (
    lane           text PRIMARY KEY,
    last_tenant_id uuid,
    updated_at     timestamptz NOT NULL DEFAULT now()
);

-- Starvation and head-of-line interventions, so none happens silently.
CREATE TABLE scheduler_intervention (
    intervention_id bigserial PRIMARY KEY,
    lane            text NOT NULL,
    tenant_id       uuid,
    task_id         uuid,
    kind            text NOT NULL,
    detail          jsonb NOT NULL DEFAULT '{}',
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idx_scheduler_intervention_task ON scheduler_intervention (task_id, kind);
CREATE INDEX idx_scheduler_intervention_created ON scheduler_intervention (created_at);

-- Aging and starvation scans walk the queue by age.
CREATE INDEX idx_task_queued_age ON generation_task (enqueue_at) WHERE state = 'QUEUED';
