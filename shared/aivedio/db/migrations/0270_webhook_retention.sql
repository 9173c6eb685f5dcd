-- The idempotency purge (aivedio.reconcile.idempotency_purge) deletes webhook receipts and applied
-- parked webhooks past timers.webhook_receipt_ttl_seconds, oldest first: these indexes let it find
-- them without reading the whole table each run.
CREATE INDEX IF NOT EXISTS idx_webhook_receipt_received ON webhook_receipt (received_at);
CREATE INDEX IF NOT EXISTS idx_parked_webhook_done ON parked_webhook (done_at) WHERE state <> 'PARKED';
