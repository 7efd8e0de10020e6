"""What the tests share: models and references, servers, traces, faults (test-only
hooks: production code carries none)."""
