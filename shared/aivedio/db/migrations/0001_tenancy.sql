-- 0001: shared trigger functions, tenants, users, API keys, scheduling policy,
-- HTTP idempotency, rate-limit fallback, transactional outbox.
-- Plain SQL, no transaction statements: the runner wraps each file in one.

-- Generic guard for append-only tables (ledger, audit, provider cost events).
-- Corrections are new rows (ch.20.2 principle 2), never UPDATE/DELETE/TRUNCATE.
CREATE FUNCTION aivedio_forbid_mutation() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only: % rejected', TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'P0001',
              HINT = 'append a reversing or compensating row instead';
END;
$$;

-- Fills NEW.tenant_id from a parent row when the caller omits it, so inserts
-- written against the chapter column lists still work; composite FKs
-- (tenant_id, parent_id) then guarantee a supplied tenant_id is consistent.
-- TG_ARGV: parent table, parent key column, child column holding that key.
CREATE FUNCTION aivedio_fill_tenant_id() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    parent_tenant uuid;
BEGIN
    IF NEW.tenant_id IS NULL THEN
        EXECUTE format('SELECT tenant_id FROM %I WHERE %I = $1', TG_ARGV[0], TG_ARGV[1])
            INTO parent_tenant
            USING (to_jsonb(NEW) ->> TG_ARGV[2])::uuid;
        NEW.tenant_id := parent_tenant;
    END IF;
    RETURN NEW;
END;
$$;

CREATE TABLE tenant (
    tenant_id     uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name          text NOT NULL UNIQUE,
    service_class text NOT NULL
        CONSTRAINT tenant_service_class_check
        CHECK (service_class IN ('ENTERPRISE_RESERVED', 'PAID_SHARED', 'STANDARD', 'BEST_EFFORT')),
    status        text NOT NULL DEFAULT 'ACTIVE',
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE app_user (
    user_id    uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id  uuid NOT NULL REFERENCES tenant (tenant_id),
    name       text NOT NULL,
    role       text NOT NULL DEFAULT 'MEMBER',
    created_at timestamptz NOT NULL DEFAULT now(),
    -- target of composite FKs: a user row can only be used with its own tenant
    CONSTRAINT app_user_tenant_user_key UNIQUE (tenant_id, user_id)
);

CREATE TABLE api_key (
    key_id     uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id  uuid NOT NULL,
    user_id    uuid NOT NULL,
    -- sha256 hex of the secret; the secret itself is never stored
    key_hash   text NOT NULL UNIQUE
        CONSTRAINT api_key_hash_sha256_hex CHECK (key_hash ~ '^[0-9a-f]{64}$'),
    key_prefix text,
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz,
    CONSTRAINT api_key_user_fk FOREIGN KEY (tenant_id, user_id)
        REFERENCES app_user (tenant_id, user_id)
);
CREATE INDEX idx_api_key_tenant ON api_key (tenant_id);

-- ch.18.9.2 plus per-user limits, rate limits and DRR burst knobs.
-- Defaults of the added columns are the ch.18.5.1 examples; the app normally
-- writes every column from its config.
CREATE TABLE tenant_scheduling_policy (
    tenant_id                   uuid PRIMARY KEY REFERENCES tenant (tenant_id),
    service_class               text    NOT NULL
        CONSTRAINT tsp_service_class_check
        CHECK (service_class IN ('ENTERPRISE_RESERVED', 'PAID_SHARED', 'STANDARD', 'BEST_EFFORT')),
    weight                      integer NOT NULL CONSTRAINT tsp_weight_positive CHECK (weight > 0),
    max_queued_tasks            integer NOT NULL CHECK (max_queued_tasks >= 0),
    max_queued_units            bigint  NOT NULL CHECK (max_queued_units >= 0),
    max_running_tasks           integer NOT NULL CHECK (max_running_tasks >= 0),
    max_running_units           bigint  NOT NULL CHECK (max_running_units >= 0),
    max_cost_per_minute         bigint  NOT NULL CHECK (max_cost_per_minute >= 0),
    max_cost_per_day            bigint  NOT NULL CHECK (max_cost_per_day >= 0),
    reserved_units              bigint  NOT NULL CHECK (reserved_units >= 0),
    burst_units                 bigint  NOT NULL CHECK (burst_units >= 0),
    max_wait_seconds            integer NOT NULL CHECK (max_wait_seconds >= 0),
    policy_version              bigint  NOT NULL DEFAULT 1 CHECK (policy_version >= 0),
    updated_at                  timestamptz NOT NULL DEFAULT now(),
    max_user_queued_tasks       integer NOT NULL DEFAULT 20  CHECK (max_user_queued_tasks >= 0),
    max_user_queued_units       bigint  NOT NULL DEFAULT 100 CHECK (max_user_queued_units >= 0),
    max_user_running_tasks      integer NOT NULL DEFAULT 2   CHECK (max_user_running_tasks >= 0),
    max_user_running_units      bigint  NOT NULL DEFAULT 24  CHECK (max_user_running_units >= 0),
    user_submit_rate_per_minute   integer NOT NULL DEFAULT 5   CHECK (user_submit_rate_per_minute >= 0),
    tenant_submit_rate_per_minute integer NOT NULL DEFAULT 100 CHECK (tenant_submit_rate_per_minute >= 0),
    cancel_rate_per_minute      integer NOT NULL DEFAULT 30  CHECK (cancel_rate_per_minute >= 0),
    allow_best_effort_downgrade boolean NOT NULL DEFAULT false,
    expensive_allowed           boolean NOT NULL DEFAULT false,
    burst_rounds                integer NOT NULL DEFAULT 4   CHECK (burst_rounds >= 0),
    initial_burst_credit        bigint  NOT NULL DEFAULT 0   CHECK (initial_burst_credit >= 0)
);

-- Every policy version ever in force, so a task's policy_version stays explainable.
CREATE TABLE tenant_policy_history (
    tenant_id      uuid   NOT NULL REFERENCES tenant (tenant_id),
    policy_version bigint NOT NULL,
    policy         jsonb  NOT NULL,
    operator       text   NOT NULL,
    reason         text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, policy_version)
);

-- HTTP Idempotency-Key layer (ch.18.16.1 "API 创建任务"): replay the first response.
CREATE TABLE idempotency_record (
    tenant_id       uuid NOT NULL REFERENCES tenant (tenant_id),
    idempotency_key text NOT NULL
        CONSTRAINT idempotency_record_key_length CHECK (char_length(idempotency_key) BETWEEN 1 AND 255),
    request_hash    text NOT NULL,
    status          text NOT NULL DEFAULT 'IN_PROGRESS'
        CONSTRAINT idempotency_record_status_check CHECK (status IN ('IN_PROGRESS', 'COMPLETED')),
    response_status integer,
    response_body   text,
    task_id         uuid,
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL DEFAULT now() + interval '24 hours',
    locked_until    timestamptz,
    PRIMARY KEY (tenant_id, idempotency_key),
    -- a completed record must be replayable byte for byte
    CONSTRAINT idempotency_record_completed_has_response
        CHECK (status <> 'COMPLETED' OR response_status IS NOT NULL)
);
CREATE INDEX idx_idempotency_record_expires ON idempotency_record (expires_at);

-- PostgreSQL fallback for token buckets when Redis is unavailable.
CREATE TABLE rate_limit_bucket (
    bucket_key text PRIMARY KEY,
    tokens     numeric NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Transactional outbox (ch.18.3 / ch.20.8.1): written in the business transaction.
CREATE TABLE outbox_event (
    event_id       uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    event_type     text NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id   uuid,
    tenant_id      uuid,
    payload        jsonb NOT NULL DEFAULT '{}',
    status         text NOT NULL DEFAULT 'PENDING'
        CONSTRAINT outbox_event_status_check CHECK (status IN ('PENDING', 'PUBLISHED', 'FAILED')),
    attempts       integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_retry_at  timestamptz NOT NULL DEFAULT now(),
    last_error     text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    published_at   timestamptz
);
CREATE INDEX idx_outbox_status_next_retry ON outbox_event (status, next_retry_at);

-- Consumer-side dedupe of at-least-once events (ch.18.16.1 "MQ 事件 event_id").
CREATE TABLE processed_event (
    consumer     text NOT NULL,
    event_id     uuid NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);
