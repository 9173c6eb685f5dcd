-- 0180: claims over a trailing window (aivedio.admin.fair_share: delivered units per lane and
-- tenant; the router's recent provider outcomes) read task_attempt by created_at, which had no
-- index. Attempts are appended in created_at order, so a BRIN index serves the range at a fraction
-- of a btree's cost per claim (0060 took indexes off the claim's path for that cost).
CREATE INDEX idx_task_attempt_created_brin ON task_attempt USING brin (created_at);
