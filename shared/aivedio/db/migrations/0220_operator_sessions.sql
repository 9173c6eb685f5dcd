-- 0220: the dashboard's sign-in sessions (aivedio.admin.operators, functions/admin_api/routes/dashboard.py).
-- The session cookie held the operator token itself: a long-lived admin credential in the browser's
-- cookie store, still valid after sign-out. It now holds a session id of its own, stored as sha256
-- hex only, that ends on sign-out, at expires_at, or when the operator's token is rotated (token_hash
-- is the hash of the token it was opened with) or the operator revoked.
CREATE TABLE operator_session (
    session_hash text PRIMARY KEY
        CONSTRAINT operator_session_hash_hex CHECK (session_hash ~ '^[0-9a-f]{64}$'),
    operator_id  uuid NOT NULL REFERENCES operator_account (operator_id),
    token_hash   text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    ended_at     timestamptz,
    CONSTRAINT operator_session_expires_after_creation CHECK (expires_at > created_at)
);
-- Each sign-in deletes the sessions that expired a day ago or more (operators.open_session).
CREATE INDEX operator_session_expires_at ON operator_session (expires_at);
