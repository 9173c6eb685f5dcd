-- 0002: tasks, attempts, fencing tokens, resource pool shards and reservations
-- (ch.18.9), task outputs, webhook dedupe.
-- FKs between business tables are DEFERRABLE INITIALLY DEFERRED: rows of one
-- unit of work are written in one transaction and their order must not matter.

CREATE TABLE generation_task (
    task_id               uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id             uuid NOT NULL,
    user_id               uuid NOT NULL,
    queue_class           text NOT NULL
        CONSTRAINT generation_task_queue_class_check
        CHECK (queue_class IN ('ENTERPRISE_RESERVED', 'PAID_SHARED', 'STANDARD',
                               'BEST_EFFORT', 'EXPENSIVE', 'RECOVERY')),
    priority_band         smallint NOT NULL
        CONSTRAINT generation_task_priority_band_check CHECK (priority_band BETWEEN 0 AND 4),
    resource_class        text NOT NULL,
    state                 text NOT NULL DEFAULT 'QUEUED'
        CONSTRAINT generation_task_state_check
        CHECK (state IN ('QUEUED', 'DISPATCHING', 'SUBMITTED', 'RUNNING', 'SUBMIT_UNKNOWN',
                         'CANCEL_REQUESTED', 'PROVIDER_SUCCEEDED', 'MEDIA_PROCESSING',
                         'SUCCEEDED', 'FAILED', 'CANCELLED', 'MEDIA_INGEST_FAILED',
                         'MANUAL_REVIEW')),
    version               bigint NOT NULL DEFAULT 0 CHECK (version >= 0),
    model_code            text NOT NULL,
    selected_provider     text,
    selected_account      text,
    fairness_units        bigint NOT NULL CONSTRAINT generation_task_fairness_units_check CHECK (fairness_units >= 0),
    provider_slot_units   bigint NOT NULL CONSTRAINT generation_task_provider_slot_units_check CHECK (provider_slot_units >= 0),
    estimated_cost_units  bigint NOT NULL CONSTRAINT generation_task_estimated_cost_units_check CHECK (estimated_cost_units >= 0),
    enqueue_at            timestamptz NOT NULL DEFAULT now(),
    next_eligible_at      timestamptz NOT NULL DEFAULT now(),
    deadline_at           timestamptz,
    current_attempt_id    uuid,
    policy_version        bigint NOT NULL,
    estimate_version      bigint NOT NULL,
    idempotency_key       text NOT NULL
        CONSTRAINT generation_task_idempotency_key_length CHECK (char_length(idempotency_key) BETWEEN 1 AND 255),
    created_at            timestamptz NOT NULL DEFAULT now(),
    updated_at            timestamptz NOT NULL DEFAULT now(),
    -- request (tenant-api.md), normalized server-side
    mode                  text NOT NULL
        CONSTRAINT generation_task_mode_check
        CHECK (mode IN ('text_to_video', 'image_to_video', 'video_to_video', 'extend')),
    prompt                text,
    duration_seconds      integer NOT NULL CHECK (duration_seconds > 0),
    resolution            text NOT NULL
        CONSTRAINT generation_task_resolution_check CHECK (resolution IN ('480p', '720p', '1080p', '4k')),
    with_audio            boolean NOT NULL DEFAULT false,
    interactive           boolean NOT NULL DEFAULT false,
    inputs                jsonb NOT NULL DEFAULT '[]',
    normalized_params     jsonb,
    -- further resource dimensions (ch.18.2 principle 3)
    gpu_units             bigint NOT NULL DEFAULT 0 CONSTRAINT generation_task_gpu_units_check CHECK (gpu_units >= 0),
    media_units           bigint NOT NULL DEFAULT 0 CONSTRAINT generation_task_media_units_check CHECK (media_units >= 0),
    -- aging (ch.18.6.6) moves priority_band; base_priority_band keeps the admitted band
    base_priority_band    smallint NOT NULL
        CONSTRAINT generation_task_base_priority_band_check CHECK (base_priority_band BETWEEN 0 AND 4),
    aging_promotions      smallint NOT NULL DEFAULT 0 CHECK (aging_promotions >= 0),
    skip_count            integer NOT NULL DEFAULT 0 CHECK (skip_count >= 0),
    capacity_mode         text CONSTRAINT generation_task_capacity_mode_check
        CHECK (capacity_mode IN ('NORMAL', 'BORROWED')),
    started_at            timestamptz,
    finished_at           timestamptz,
    error_code            text,
    error_message         text,
    current_fencing_token bigint,
    cancel_requested_at   timestamptz,
    admission_decision    text,
    CONSTRAINT generation_task_tenant_idempotency_key UNIQUE (tenant_id, idempotency_key),
    -- target of composite FKs from child tables (tenant consistency)
    CONSTRAINT generation_task_tenant_task_key UNIQUE (tenant_id, task_id),
    CONSTRAINT generation_task_user_fk FOREIGN KEY (tenant_id, user_id)
        REFERENCES app_user (tenant_id, user_id)
);

-- base_priority_band defaults to the band the task was admitted with.
CREATE FUNCTION generation_task_defaults() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.base_priority_band := coalesce(NEW.base_priority_band, NEW.priority_band);
    RETURN NEW;
END;
$$;
CREATE TRIGGER generation_task_defaults BEFORE INSERT ON generation_task
    FOR EACH ROW EXECUTE FUNCTION generation_task_defaults();

-- ch.18.9.1, verbatim
CREATE INDEX idx_task_schedulable
ON generation_task (
    queue_class,
    tenant_id,
    priority_band,
    next_eligible_at,
    enqueue_at
)
WHERE state = 'QUEUED';

-- GET /v1/generations: newest first, keyset cursor on (created_at, task_id)
CREATE INDEX idx_task_tenant_created ON generation_task (tenant_id, created_at DESC, task_id DESC);
CREATE INDEX idx_task_tenant_user_state ON generation_task (tenant_id, user_id, state);
-- scanners for stuck non-terminal tasks (ch.18.16.6)
CREATE INDEX idx_task_inflight ON generation_task (state, updated_at)
    WHERE state NOT IN ('QUEUED', 'SUCCEEDED', 'FAILED', 'CANCELLED');

-- Monotonic fencing tokens (ch.18.16.3); one per attempt.
CREATE SEQUENCE fencing_token_seq AS bigint;

-- ch.18.9.5 task_attempt merged with ch.20.5.5 provider_attempt.
-- Name mapping: provider_account_id -> provider_account,
-- external_idempotency_key -> provider_request_key, provider_task_id -> provider_job_id,
-- submit_state -> state.
CREATE TABLE task_attempt (
    attempt_id              uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    task_id                 uuid NOT NULL,
    tenant_id               uuid NOT NULL,
    attempt_no              integer NOT NULL CHECK (attempt_no >= 1),
    provider                text NOT NULL,
    provider_account        text NOT NULL,
    provider_request_key    text NOT NULL,
    provider_job_id         text,
    state                   text NOT NULL,
    fencing_token           bigint NOT NULL DEFAULT nextval('fencing_token_seq'),
    submit_started_at       timestamptz,
    submit_finished_at      timestamptz,
    next_check_at           timestamptz,
    error_class             text,
    error_code              text,
    created_at              timestamptz NOT NULL DEFAULT now(),
    updated_at              timestamptz NOT NULL DEFAULT now(),
    model_code              text NOT NULL,
    region                  text,
    estimated_cost_amount   numeric(20, 8) NOT NULL DEFAULT 0,
    estimated_cost_currency text NOT NULL DEFAULT 'USD',
    actual_cost_amount      numeric(20, 8),
    actual_cost_currency    text,
    billable_state          text NOT NULL DEFAULT 'NOT_BILLABLE',
    lease_until             timestamptz,
    raw_last_response       jsonb,
    capacity_mode           text NOT NULL DEFAULT 'NORMAL'
        CONSTRAINT task_attempt_capacity_mode_check CHECK (capacity_mode IN ('NORMAL', 'BORROWED')),
    CONSTRAINT task_attempt_task_attempt_no_key UNIQUE (task_id, attempt_no),
    CONSTRAINT task_attempt_provider_request_key_key UNIQUE (provider, provider_request_key),
    -- NULL provider_job_id (not yet known) is allowed many times
    CONSTRAINT task_attempt_provider_job_key UNIQUE (provider, provider_account, provider_job_id),
    CONSTRAINT task_attempt_actual_cost_currency
        CHECK (actual_cost_amount IS NULL OR actual_cost_currency IS NOT NULL),
    CONSTRAINT task_attempt_task_fk FOREIGN KEY (tenant_id, task_id)
        REFERENCES generation_task (tenant_id, task_id) DEFERRABLE INITIALLY DEFERRED
);
-- webhooks carry only the job id
CREATE INDEX idx_task_attempt_provider_job ON task_attempt (provider, provider_job_id);
CREATE INDEX idx_task_attempt_state_check ON task_attempt (state, next_check_at);

-- tenant_id and model_code default from the task (chapter inserts omit them).
CREATE FUNCTION task_attempt_defaults() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.tenant_id IS NULL OR NEW.model_code IS NULL THEN
        SELECT coalesce(NEW.tenant_id, t.tenant_id), coalesce(NEW.model_code, t.model_code)
          INTO NEW.tenant_id, NEW.model_code
          FROM generation_task t WHERE t.task_id = NEW.task_id;
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER task_attempt_defaults BEFORE INSERT ON task_attempt
    FOR EACH ROW EXECUTE FUNCTION task_attempt_defaults();

-- Circular with task_attempt, hence added here and deferred.
ALTER TABLE generation_task
    ADD CONSTRAINT generation_task_current_attempt_fk FOREIGN KEY (current_attempt_id)
        REFERENCES task_attempt (attempt_id) DEFERRABLE INITIALLY DEFERRED;

-- ch.18.9.3: counters split into shards to avoid one hot row.
CREATE TABLE resource_pool_shard (
    resource_key   text    NOT NULL,
    shard_no       integer NOT NULL CHECK (shard_no >= 0),
    capacity_units bigint  NOT NULL
        CONSTRAINT resource_pool_shard_capacity_nonneg CHECK (capacity_units >= 0),
    used_units     bigint  NOT NULL DEFAULT 0
        CONSTRAINT resource_pool_shard_used_nonneg CHECK (used_units >= 0),
    version        bigint  NOT NULL DEFAULT 0,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (resource_key, shard_no),
    -- last line of defence behind the conditional UPDATE of ch.18.9.3
    CONSTRAINT resource_pool_shard_used_within_capacity CHECK (used_units <= capacity_units)
);

-- ch.18.9.4. Counters are rebuilt from ACTIVE rows (ch.18.16.6), so these are the facts.
CREATE TABLE resource_reservation (
    reservation_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    task_id        uuid   NOT NULL,
    attempt_id     uuid   NOT NULL REFERENCES task_attempt (attempt_id) DEFERRABLE INITIALLY DEFERRED,
    tenant_id      uuid   NOT NULL,
    resource_key   text   NOT NULL,
    shard_no       integer NOT NULL,
    reserved_units bigint NOT NULL CONSTRAINT resource_reservation_units_positive CHECK (reserved_units > 0),
    state          text   NOT NULL DEFAULT 'ACTIVE'
        CONSTRAINT resource_reservation_state_check CHECK (state IN ('ACTIVE', 'RELEASED')),
    lease_until    timestamptz NOT NULL,
    fencing_token  bigint NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    released_at    timestamptz,
    capacity_mode  text NOT NULL DEFAULT 'NORMAL'
        CONSTRAINT resource_reservation_capacity_mode_check CHECK (capacity_mode IN ('NORMAL', 'BORROWED')),
    CONSTRAINT resource_reservation_attempt_shard_key UNIQUE (attempt_id, resource_key, shard_no),
    CONSTRAINT resource_reservation_released_at
        CHECK (state <> 'RELEASED' OR released_at IS NOT NULL),
    CONSTRAINT resource_reservation_task_fk FOREIGN KEY (tenant_id, task_id)
        REFERENCES generation_task (tenant_id, task_id) DEFERRABLE INITIALLY DEFERRED,
    CONSTRAINT resource_reservation_shard_fk FOREIGN KEY (resource_key, shard_no)
        REFERENCES resource_pool_shard (resource_key, shard_no) DEFERRABLE INITIALLY DEFERRED
);
-- ch.18.16.1 "资源预留 attempt_id + resource_key": one live reservation per resource
CREATE UNIQUE INDEX uq_resource_reservation_active
    ON resource_reservation (attempt_id, resource_key) WHERE state = 'ACTIVE';
CREATE INDEX idx_resource_reservation_expiry
    ON resource_reservation (lease_until) WHERE state = 'ACTIVE';
CREATE INDEX idx_resource_reservation_pool
    ON resource_reservation (resource_key, shard_no) WHERE state = 'ACTIVE';
CREATE INDEX idx_resource_reservation_task ON resource_reservation (task_id);
CREATE TRIGGER resource_reservation_fill_tenant BEFORE INSERT ON resource_reservation
    FOR EACH ROW EXECUTE FUNCTION aivedio_fill_tenant_id('generation_task', 'task_id', 'task_id');

-- Output assets, idempotent per ch.18.16.1 "输出资产 task_id + output_version".
CREATE TABLE task_output (
    task_id        uuid    NOT NULL,
    tenant_id      uuid    NOT NULL,
    output_version integer NOT NULL DEFAULT 1 CHECK (output_version >= 1),
    asset_type     text    NOT NULL,
    object_key     text    NOT NULL,
    url            text,
    content_type   text,
    size_bytes     bigint CHECK (size_bytes >= 0),
    duration_ms    bigint CHECK (duration_ms >= 0),
    checksum       text,
    metadata       jsonb   NOT NULL DEFAULT '{}',
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, output_version, asset_type),
    CONSTRAINT task_output_task_fk FOREIGN KEY (tenant_id, task_id)
        REFERENCES generation_task (tenant_id, task_id) DEFERRABLE INITIALLY DEFERRED
);
CREATE TRIGGER task_output_fill_tenant BEFORE INSERT ON task_output
    FOR EACH ROW EXECUTE FUNCTION aivedio_fill_tenant_id('generation_task', 'task_id', 'task_id');

-- Provider webhook dedupe (delivery is at least once, provider-protocol.md).
CREATE TABLE webhook_receipt (
    provider    text NOT NULL,
    webhook_id  text NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (provider, webhook_id)
);
