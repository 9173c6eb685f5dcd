-- 0005: per-tenant admitted cost per window, so the minute and day cost budgets are a single
-- row read under the wallet lock instead of a scan of the day's tasks.
CREATE TABLE tenant_cost_window (
    tenant_id    uuid        NOT NULL REFERENCES tenant (tenant_id),
    window_kind  text        NOT NULL CHECK (window_kind IN ('MINUTE', 'DAY')),
    window_start timestamptz NOT NULL,
    cost_units   bigint      NOT NULL DEFAULT 0 CHECK (cost_units >= 0),
    PRIMARY KEY (tenant_id, window_kind, window_start)
);
CREATE INDEX idx_tenant_cost_window_start ON tenant_cost_window (window_start);
