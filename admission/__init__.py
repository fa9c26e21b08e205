"""admission: a pure admission policy over a snapshot of cluster load, and the controller that
applies it on the router's event loop (admit, queue with a bounded wait, or reject; see
docs/structure.md)."""
