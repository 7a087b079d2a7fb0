"""The metadata service: which node holds which block in which tier, with leases and events."""
