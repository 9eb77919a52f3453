"""What the worker's two processes and the router share that is not the cache: tokenizer loading
(tokenizer_load.py, tokenizer_light.py), chat-template rendering (chat_jinja.py), the prompt normal
form of every API face (prompt_form.py), tenants and their salts (tenants.py), the JSON nesting
guard (json_depth.py) and the Host rules (host_policy.py). It imports neither ``serving`` nor
``router`` nor ``edge``, and no HTTP framework; the cache core (``hicache``) does not import it
(tests/layout/test_layering.py)."""
