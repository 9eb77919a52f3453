"""The engine's shared records, at the bottom of its import graph: a request (``request.Req``), its
sampling parameters (``sampling_params.SamplingParams``) and a forward pass's batch
(``forward_batch.ForwardBatch``), and what a request's structured output asks for (``grammar_spec``).
Every engine package imports these; they import no other engine package (``serving.compat_fields``,
a leaf, aside): tests/layout/test_layering.py."""
