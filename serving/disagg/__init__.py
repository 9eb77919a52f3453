"""Prefill-decode disaggregation."""
