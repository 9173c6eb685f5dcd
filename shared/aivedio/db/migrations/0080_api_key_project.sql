-- 0080: projects (ch. 20.9.4 "租户或项目周期预算"). A project is an attribute of an API key, set by
-- the operator who issues the key (`aivedio admin api-key create --project`), never by a request.
-- Admission copies the caller's key's project onto the task, so the claim can reserve the task's
-- provider spend against the PROJECT budget, whose scope id is "{tenant_id}:{project}".
ALTER TABLE api_key ADD COLUMN project text
    CONSTRAINT api_key_project_name CHECK (project ~ '^[A-Za-z0-9_.-]{1,64}$');

-- Copied from api_key.project (checked there); null for a key without a project. No index: the
-- scheduler reads it from task rows it has already selected.
ALTER TABLE generation_task ADD COLUMN project_id text;
