"""The C++ CPU ops' cost per row at few rows (a speculative verify pass, a small decode batch).

    .venv/bin/python bench/cpu_rows.py [--rows 1,2,4,8,9,16] [--keys 777] [--variant avx2] [--json PATH]

SmolLM2-135M's shapes, random weights, 1 torch thread: one layer's four projections (qkv 960 x 576,
o 576 x 576, gate_up 3072 x 576, down 576 x 1536) in int4 (W4A16, Q4_1 blocks), int8 (W8A8) and fp32
(``F.linear``), the q8 LM head (49152 x 576) and the paged attention of 30 layers over ``--keys``
keys of one sequence (its rows the sequence's last tokens, as in a verify pass; every layer's K/V
its own, so they come from memory as in a decode step). Each figure is the best of 5 samples of
10 calls, in ms, with its ratio to the first ``--rows`` value: a kernel that loads the weights or
the KV once for all the rows stays near 1x while it is memory-bound; compute grows with the rows.
One layer's weights stay in cache between calls (the 1-row projection figures are compute, not
DRAM as in a real decode step); the attention's 30 layers of K/V do not.
``--variant`` picks the C++ variant (serving.kernels.cpu_ext: every variant gives the same bits).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import parser, print_table, write_json  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS, KV_HEADS, HEADS, HEAD_DIM, VOCAB = 30, 3, 9, 64, 49152


def best_ms(fn, calls: int = 10, samples: int = 5) -> float:
    fn()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return min(times)


def measure(ext, m: int, g: torch.Generator, keys: int, int4, int8, fp32, head, kv) -> dict[str, float]:  # noqa: ANN001
    """Each op's best time (ms) at ``m`` rows."""
    x = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
    q = torch.randn(m, HEADS, HEAD_DIM, generator=g)
    slots = torch.arange(keys + m)[None]
    seq, nkeys = torch.zeros(m, dtype=torch.int64), torch.arange(keys + 1, keys + m + 1)
    return {"int4_layer_ms": best_ms(lambda: [ext.int4_linear(x[k], w) for w, k in int4]),
            "int8_layer_ms": best_ms(lambda: [ext.int8_linear(x[k], w, s, c) for w, s, c, k in int8]),
            "fp32_layer_ms": best_ms(lambda: [torch.nn.functional.linear(x[k], w) for w, k in fp32]),
            "q8_head_ms": best_ms(lambda: ext.q8_linear(x[576], head)),
            "attention_30_layers_ms": best_ms(
                lambda: [ext.paged_attention(q, k, v, slots, seq, nkeys, 0.125) for k, v in kv], calls=3)}


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,9,16")
    p.add_argument("--keys", type=int, default=777, help="keys the attention rows see (before their own)")
    p.add_argument("--variant", default=None, help="a serving.kernels.cpu_ext variant (default: the one in use)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from serving.kernels import cpu_ext, cpu_int4, cpu_q8

    ext = cpu_ext.build(args.variant) if args.variant else cpu_ext.extension()
    if ext is None:
        raise SystemExit("no C++ CPU ops here")
    g = torch.Generator().manual_seed(0)
    int4, int8, fp32 = [], [], []
    for n, k in SHAPES:
        d = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4
        int4.append((cpu_int4.pack(torch.randint(0, 16, (n, k), generator=g), d, -8 * d), k))
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        int8.append((w, w.long().sum(1), torch.rand(n, generator=g) * 0.01, k))
        fp32.append((torch.randn(n, k, generator=g), k))
    head = cpu_q8.pack(torch.randint(-127, 128, (VOCAB, 576), dtype=torch.int8, generator=g),
                       torch.rand(VOCAB, 18, generator=g) * 0.01)
    slots_total = args.keys + 64
    kv = [(torch.randn(slots_total, KV_HEADS, HEAD_DIM, generator=g),
           torch.randn(slots_total, KV_HEADS, HEAD_DIM, generator=g)) for _ in range(LAYERS)]
    rows = [int(r) for r in args.rows.split(",")]
    res: dict = {"variant": ext.variant, "threads": 1, "keys": args.keys, "load_average": os.getloadavg(),
                 "date": time.strftime("%Y-%m-%d"), "rows": []}
    base: dict[str, float] = {}
    table = []
    for m in rows:
        row = {"rows": m, **measure(ext, m, g, args.keys, int4, int8, fp32, head, kv)}
        base = base or {k: v for k, v in row.items() if k != "rows"}
        res["rows"].append(row)
        table.append([m] + [f"{row[k]:.3f} ({row[k] / base[k]:.2f}x)" for k in base])
    print(f"variant {ext.variant}, 1 thread, {args.keys} keys")
    print_table(["rows", *base], table)
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
