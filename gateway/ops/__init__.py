"""Operator endpoints: TTFT metrics, cache advice and the dashboard."""
