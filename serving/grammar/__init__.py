"""Structured output: constrain decoding to a JSON schema, a regular expression or an EBNF grammar.

- ``serving.structs.grammar_spec`` (beside the request records): what a request asks for
  (``json_schema`` / ``regex`` / ``ebnf`` in sampling params,
  OpenAI ``response_format``), as a ``(kind, text)`` pair.
- ``base`` / ``registry``: the grammar-backend contract and the registry behind
  ``--grammar-backend`` (``xgrammar``, or ``none`` to turn structured output off).
- ``xgrammar_backend``: the xgrammar implementation (tokenizer info built once, compiler with
  its own cache, batched bitmask fill / apply); ``deferred``: the engine's backend is built on
  its first use (the first grammar), not at start.
- ``lru``: compiled grammars cached by ``(kind, text)``.
- ``runner``: what the scheduler calls: per-request matchers, masks filled on a worker thread
  while the forward pass runs, applied to the logits before sampling, jump-forward.
- ``compile_pool`` / ``compile_job`` / ``compile_worker`` / ``memory_limits``: compiles with a
  time and a memory budget (a trial in a worker process first), and the future of one.
"""

# Nothing is imported here: the HTTP process imports serving.structs.grammar_spec, and the
# HTTP process should not load xgrammar. Import the submodules.
