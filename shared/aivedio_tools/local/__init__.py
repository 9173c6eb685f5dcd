"""Everything that makes the platform run for real on one machine."""
