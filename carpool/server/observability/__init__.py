"""Prometheus metrics, the live view and the dashboard."""
