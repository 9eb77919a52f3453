"""The cache's controllers in the engine process: the request <-> tree adapter, L1 <-> L2 copies,
L3 prefetch and write-back, the load-or-recompute cost model, the KV control API's engine side.
README.md says what each module does, which thread calls it, and the order of a hit. Import the
modules; this file re-exports nothing.
"""
