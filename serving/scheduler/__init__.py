"""The scheduler: continuous batching (``scheduler``), queue order (``schedule_policy``), overlap
scheduling (``overlap``), a request's state (``request``), its sampling parameters
(``sampling_params``), the prompt's rules (``prompt_check``) and stop rules (``stop``). Import the
modules; this file re-exports nothing.
"""
