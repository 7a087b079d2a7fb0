"""The node agent: the sidecar that owns a host's host and disk tiers and serves its workers."""
