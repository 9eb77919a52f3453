"""What tests and benchmarks use to run the real thing: server processes (``server_utils``), tiny
models and the converted SmolLM2 (``model_utils``), network namespaces (``netns``), a real
Mooncake master (``mooncake_master``), PD clusters (``pd_cluster``, also a script; ``pd_pair``, a
NIXL pair behind the PD router beside a colocated reference) and
tensor-parallel ranks (``tp_utils``),
a slowed-down LMDB store (``slow_storage``), a stand-in PD worker (``fake_pd_worker``), the CPU
extension's variants (``cpu_variants``) and the frontend language's tutorial programs and checks
(``lang_programs``, ``lang_checks``), the import graph the layering tests check
(``import_graph``) and the soak test's traffic (``soak_mix``).

``tests/`` and ``bench/`` import this package and never each other; it imports neither
(``tests/layout/test_harness_layering.py``).
"""
