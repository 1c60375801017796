"""Providers and their launch: manifests, weights, environments, kits, worker processes."""
