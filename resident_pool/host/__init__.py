"""What this host gives the pool: per-user folders, trust checks on files, process groups."""
