"""The HTTP edge the worker's HTTP process (serving/server) and the router share: how a
connection is read (edge/http_protocol.py: uvicorn's h11 protocol with read timeouts, and the
framing guard). It imports neither ``serving`` nor ``router`` (their error shapes come in as
arguments); ``hicache`` does not import it (tests/layout/test_layering.py)."""
