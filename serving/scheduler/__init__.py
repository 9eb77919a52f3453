"""The scheduler: continuous batching (``scheduler``), queue order (``schedule_policy``), overlap
scheduling (``overlap``), a request's state (``request``), its sampling parameters
(``sampling_params``) and stop rules (``stop``). Import the modules; this file re-exports nothing.
"""
