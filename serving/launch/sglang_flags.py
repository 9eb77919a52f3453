"""Every flag of SGLang's ``launch_server`` (its ``ServerArgs``), by name, with how many values it
takes: ``sglang_flags.json`` beside this module, generated from the SGLang release named in it
(``python -m serving.launch.sglang_flags``, with ``sglang`` installed: the test extras have it;
tests/server/test_sglang_launch.py checks the file against the installed release).

``hicache serve`` parses all of them (serving/launch/sglang_compat.py), so that an SGLang launch line
never fails on "unrecognized arguments": a flag that is a config field or in sglang_compat's table does
what it says there, and any other SGLang flag is refused in one line that names the table of what is
supported. A flag that is no SGLang flag at all is still argparse's error.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

DATA = Path(__file__).with_name("sglang_flags.json")


@cache
def sglang_flags() -> tuple[str, dict[str, Any]]:
    """(the SGLang release, {flag name without dashes: 0 (a switch) | 1 | "?" | "*" | "+"})."""
    data = json.loads(DATA.read_text())
    return data["release"], data["flags"]


def generate() -> dict[str, Any]:
    """The installed SGLang's flags (ImportError without it)."""
    import argparse

    import sglang
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags: dict[str, Any] = {}
    for action in parser._actions:
        for opt in action.option_strings:
            if opt.startswith("--") and opt != "--help":
                flags[opt[2:]] = 0 if action.nargs == 0 else action.nargs if action.nargs in ("*", "+", "?") else 1
    return {"release": sglang.__version__, "flags": dict(sorted(flags.items()))}


if __name__ == "__main__":
    DATA.write_text(json.dumps(generate(), indent=0) + "\n")
    print(f"wrote {DATA}")
