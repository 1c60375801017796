"""For the operator: metrics, lifecycle events, measured GPU memory, retention, systemd."""
