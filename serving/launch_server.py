"""``python -m serving.launch_server ARGS``: SGLang's spelling (``python -m sglang.launch_server``)
of ``hicache serve ARGS``, with SGLang's flags (``--model-path``, ``--host``, ``--port``, ``--tp``,
``--enable-hierarchical-cache`` ...: serving/launch/sglang_compat.py)."""

from __future__ import annotations

import sys

from serving.launch.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
