"""Validation: weights and kit checks, golden answers, provenance."""
