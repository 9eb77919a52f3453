"""The launcher: ``hicache`` (cli.py: serve, router, ...) and data parallelism (dp.py: N replicas
behind the router). The one place that imports both serving and router (tests/layout/test_layering.py)."""
