"""worker_runtime: what both worker roles share (engine thread, output sinks, health,
lifecycle, early aborts)."""
