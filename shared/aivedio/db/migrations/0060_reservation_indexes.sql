-- 0060: a claim writes one resource_reservation row per resource key (ten for a usual task), and
-- each row paid for six indexes and a trigger: most of the database's work per claim. The rows are
-- only ever looked up by attempt (release, lease renewal) or read whole (counter rebuild, checks),
-- so one key serves: (attempt_id, resource_key), unique over every state, which is the rule of
-- ch. 18.16.1 ("资源预留 attempt_id + resource_key") for live and released rows alike. The
-- tenant-filling trigger goes too: its one writer, aivedio_claim, always passes tenant_id, and the
-- column is NOT NULL, so a writer that forgets fails loudly instead of being filled in.
DROP INDEX uq_resource_reservation_active;
DROP INDEX idx_resource_reservation_expiry;
DROP INDEX idx_resource_reservation_pool;
DROP INDEX idx_resource_reservation_task;
ALTER TABLE resource_reservation DROP CONSTRAINT resource_reservation_attempt_shard_key;
ALTER TABLE resource_reservation DROP CONSTRAINT resource_reservation_pkey;
ALTER TABLE resource_reservation DROP COLUMN reservation_id;
ALTER TABLE resource_reservation ADD CONSTRAINT resource_reservation_pkey PRIMARY KEY (attempt_id, resource_key);
DROP TRIGGER resource_reservation_fill_tenant ON resource_reservation;
