"""Tests of gateway.telemetry."""
