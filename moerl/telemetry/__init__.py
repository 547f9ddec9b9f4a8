"""Metrics: train/inference mismatch, staleness, and (later) run telemetry."""
