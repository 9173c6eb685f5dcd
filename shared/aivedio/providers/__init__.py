"""AI video providers: the adapter interface and its HTTP implementation for
docs/provider-protocol.md (adapter.py), Standard Webhooks signatures (webhooks.py), and the
provider simulator with its `aivedio provider-sim` command (simulator.py, cli.py)."""
