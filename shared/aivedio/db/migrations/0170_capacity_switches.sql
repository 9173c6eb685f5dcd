-- Issue 16: capacities, borrowing limits, provider account concurrency and admission switches that
-- an operator changes at run time (aivedio.admin.capacity). The config file stays the default; a
-- row here overrides the named fields of one lane, pool, provider account or switch, in every
-- process within seconds. Each change is audited in audit_log with its old and new values.
CREATE TABLE capacity_override (
    kind       text   NOT NULL
        CONSTRAINT capacity_override_kind_check CHECK (kind IN ('LANE', 'POOL', 'PROVIDER_ACCOUNT', 'SWITCH')),
    key        text   NOT NULL CONSTRAINT capacity_override_key_nonempty CHECK (key <> ''),
    -- the overridden fields only, e.g. {"capacity_units": 800} or {"open": false}
    settings   jsonb  NOT NULL CONSTRAINT capacity_override_settings_object CHECK (jsonb_typeof(settings) = 'object'),
    version    bigint NOT NULL DEFAULT 1 CONSTRAINT capacity_override_version_positive CHECK (version >= 1),
    updated_by text   NOT NULL,
    reason     text            CONSTRAINT capacity_override_reason_nonempty CHECK (reason <> ''),
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kind, key)
);

-- Price versions an operator creates (aivedio.pricing.price_book.create_price_version) name who and
-- why; a version derived from the config has neither. The immutability trigger of 0003 covers them.
ALTER TABLE price_book ADD COLUMN created_by text;
ALTER TABLE price_book ADD COLUMN reason text;
