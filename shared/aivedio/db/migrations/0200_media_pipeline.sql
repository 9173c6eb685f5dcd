-- 0200: the media pipeline (issue 17; aivedio.media.pipeline). A provider's success writes one
-- media_job per (task, output version) in the transaction that moves the task to
-- PROVIDER_SUCCEEDED; a dispatcher claims it (PENDING -> RUNNING, worker slots reserved as
-- resource_reservation rows of the task's attempt on the pools worker:<resource class>, a new
-- fencing token), a worker fetches, checks, transcodes and stores the output, and its RESULT is
-- applied once, fenced on (task_id, output_version, fencing_token). A retry keeps the output
-- version, so a task has one set of outputs however often its worker ran.
CREATE TABLE media_job (
    task_id          uuid    NOT NULL,
    tenant_id        uuid    NOT NULL,
    output_version   integer NOT NULL DEFAULT 1 CONSTRAINT media_job_output_version_check CHECK (output_version >= 1),
    attempt_id       uuid    NOT NULL REFERENCES task_attempt (attempt_id) DEFERRABLE INITIALLY DEFERRED,
    -- Drawn from fencing_token_seq at creation and again at every claim: a RESULT carrying an older
    -- token is a lost worker's, and changes nothing.
    fencing_token    bigint  NOT NULL,
    resource_class   text    NOT NULL
        CONSTRAINT media_job_resource_class_check CHECK (resource_class IN ('cpu-proxy', 'gpu-render', 'gpu-highmem')),
    slot_units       bigint  NOT NULL CONSTRAINT media_job_slot_units_check CHECK (slot_units > 0),
    state            text    NOT NULL DEFAULT 'PENDING'
        CONSTRAINT media_job_state_check CHECK (state IN ('PENDING', 'RUNNING', 'SUCCEEDED', 'FAILED')),
    tries            integer NOT NULL DEFAULT 0 CONSTRAINT media_job_tries_check CHECK (tries >= 0),
    max_tries        integer NOT NULL CONSTRAINT media_job_max_tries_check CHECK (max_tries >= 1),
    next_eligible_at timestamptz NOT NULL,
    source_url       text    NOT NULL,  -- the provider's output: the platform's to fetch, never the tenant's to see
    -- What the provider reported of the job (its id, charge id, usage): the terminal event carries it
    -- to settlement when the media step ends the task.
    provider_report  jsonb   NOT NULL DEFAULT '{}',
    spec             jsonb,             -- the SPEC of the latest claim
    result           jsonb,             -- the RESULT that ended the latest try
    error_code       text,
    worker_ref       text,              -- AWS Batch job id, or local "pid:<pid>"
    lease_until      timestamptz,       -- RUNNING: past it, the media-jobs reconciler asks about the worker
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    started_at       timestamptz,
    finished_at      timestamptz,
    PRIMARY KEY (task_id, output_version),
    CONSTRAINT media_job_task_fk FOREIGN KEY (tenant_id, task_id)
        REFERENCES generation_task (tenant_id, task_id) DEFERRABLE INITIALLY DEFERRED,
    CONSTRAINT media_job_running_lease CHECK (state <> 'RUNNING' OR lease_until IS NOT NULL)
);
-- The dispatcher's scan and the reconciler's: small partial indexes, the rows in flight only.
CREATE INDEX idx_media_job_pending ON media_job (resource_class, next_eligible_at) WHERE state = 'PENDING';
CREATE INDEX idx_media_job_running ON media_job (lease_until) WHERE state = 'RUNNING';
