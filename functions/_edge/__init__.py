"""What both HTTP APIs (functions/api, functions/admin_api) share at the edge: the error contract
(errors), the thread-safe resolver (resolver), the body limits and envelope (envelope). Not a
function: it has no handler.py."""
