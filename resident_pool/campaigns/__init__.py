"""Screening campaigns: input readers, the result store, the campaign runner."""
