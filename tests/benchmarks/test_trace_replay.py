"""bench/trace_replay.py: the Mooncake trace through the real tree (policy) and through a real
server (live), with the numbers checked: the LRU-of-blocks bound against the trace README's
figures, the tree's hits against an independent count from the hash ids and against the bound,
and a live tiny server's hits per tier against what the policy replay predicts."""

from __future__ import annotations

import json

import pytest

from bench import trace_replay
from bench.trace_data import TRACE_BLOCK, BlockTokens, TraceRequest, load_trace, lru_block_bound, select
from bench.trace_policy import PolicyConfig, PolicyReplay, distinct_tokens
from bench.trace_sched import PassLoop
from harness.model_utils import tiny_model


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    return load_trace()


def test_lru_bound_reproduces_the_trace_readme(trace):
    """../shared/traces/README.md: unbounded 0.651; 1M 0.147; 4M 0.379; 16M 0.640."""
    assert len(trace) == 3993
    for cap, want in ((10**12, 0.651), (10**6, 0.147), (4 * 10**6, 0.379), (16 * 10**6, 0.640)):
        got = lru_block_bound(trace, cap)["hit_rate"]
        assert abs(got - want) < 0.0015, (cap, got, want)


def test_lru_bound_on_a_hand_made_trace():
    """Three requests, blocks of 512: b shares a's first block, c shares both of a's blocks
    (the cut last block counts its own length); with 850 tokens of room, block 2 (the least
    recent after b) leaves, so c finds only block 1."""
    a = TraceRequest(0, 0, 800, 1, (1, 2))  # blocks of 512 and 288
    b = TraceRequest(1, 0, 600, 1, (1, 3))  # hits block 1 (512)
    c = TraceRequest(2, 0, 1000, 1, (1, 2))  # hits 1 and 2 (512 + 488)
    full = lru_block_bound([a, b, c], 10**6)
    assert full == {"hit_tokens": 512 + 1000, "prompt_tokens": 2400, "hit_rate": 1512 / 2400}
    small = lru_block_bound([a, b, c], 850)  # after b: 2 (288), 1 (512), 3 (88) = 888 > 850
    assert small["hit_tokens"] == 512 + 512, small


def shared_prefix_tokens(blocks: BlockTokens, reqs: list[TraceRequest], i: int) -> int:
    """Tokens of request i's prompt that an earlier request's prompt begins with, from the hash ids."""
    r, lens = reqs[i], blocks.block_lengths(reqs[i])
    best = 0
    for q in reqs[:i]:
        qlens, n = blocks.block_lengths(q), 0
        for k, (h, g) in enumerate(zip(r.hash_ids, q.hash_ids, strict=False)):
            if h != g:
                break
            n += min(lens[k], qlens[k])
            if lens[k] != qlens[k]:
                break  # one of the two was cut inside this block
        best = max(best, n)
    return best


def test_policy_replay_counts_every_shared_prefix_with_room_for_all(trace):
    """With L1 holding the whole slice, the tree serves each prompt's longest prefix shared with
    an earlier prompt, in full pages and leaving the last token to compute: counted independently."""
    reqs = select(trace, 0, 40, busiest=6)
    blocks, ps = BlockTokens(64), 16  # 64 tokens per hash id: the slice in ~110k tokens
    rep = PolicyReplay(PolicyConfig(l1_tokens=1 << 20, page_size=ps))
    for i, r in enumerate(reqs):
        got = rep.request(blocks.tokens(r))
        want = min(shared_prefix_tokens(blocks, reqs, i), blocks.length(r) - 1) // ps * ps
        assert got == {"device": want, "host": 0, "storage": 0}, (i, got, want)
    rep.finish()  # checks the tree's integrity
    assert rep.counts.hit["device"] > 0.5 * rep.counts.prompt_tokens


def test_policy_replay_against_the_lru_bound(trace):
    """A slice (the 10 busiest chains' first 80 requests, 64 tokens per hash id: ~200k prompt
    tokens, ~24k distinct) at 8k-32k tokens of capacity: every tier serves hits, the accounting
    adds up request by request, L1 alone stays within 0.95x of an LRU of blocks with the same
    capacity, and more tiers never hit less than L1 alone nor less than 0.95x the bound at
    their largest tier (inclusive tiers hold at least that many distinct tokens)."""
    reqs = select(trace, 0, 80, busiest=10)
    blocks = BlockTokens(64)
    prompt = sum(blocks.length(r) for r in reqs)
    l1_only = {}
    for l1, l2, l3 in ((8000, 0, 0), (16000, 0, 0), (8000, 16000, 0), (8000, 8000, 16000)):
        rep = PolicyReplay(PolicyConfig(l1, l2, l3))
        for r in reqs:
            rep.request(blocks.tokens(r))
        rep.finish()  # checks the tree's integrity
        c = rep.counts
        assert c.requests == len(reqs) and c.prompt_tokens == prompt and c.rejected == 0
        for tier, cap in (("device", l1), ("host", l2), ("storage", l3)):
            assert c.hit[tier] == sum(x[tier] for x in c.per_request)
            assert (c.hit[tier] > 0) == (cap > 0), (l1, l2, l3, c.hit)
        for r, x in zip(reqs, c.per_request, strict=True):
            assert sum(x.values()) <= blocks.length(r) - 1 and sum(x.values()) % 16 == 0
        hit = c.hit_tokens / c.prompt_tokens
        if not l2:
            l1_only[l1] = hit
            assert hit >= 0.95 * lru_block_bound(reqs, l1, blocks)["hit_rate"], (l1, hit)
        else:
            assert hit > l1_only[l1], (l1, l2, l3, hit, l1_only)
            assert hit >= 0.95 * lru_block_bound(reqs, max(l1, l2, l3), blocks)["hit_rate"], (l1, l2, l3, hit)
        assert distinct_tokens(rep) <= l1 + l2 + l3


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_pass_loop_keeps_the_tree_whole_within_the_budget(trace, overlap):
    """Eight clients, a 256-token budget, L1+L2+L3 (bench/trace_sched.py): after every pass the
    tree is whole and the pass computed at most the budget; every request is admitted once and
    ends but those longer than L1 (rejected, counted), the passes compute every prompt token no tier
    served, and no L1 page is lost. With overlap scheduling the ended requests are answered a pass
    late, their pages back at once."""
    reqs = select(trace, 0, 60, busiest=8)
    blocks, budget = BlockTokens(32), 256
    rep = PolicyReplay(PolicyConfig(2048, 2048, 8192, concurrency=8, chunked_prefill_size=budget,
                                    prefetch_threshold=64, overlap_schedule=overlap))
    computed: list[int] = []

    def check(loop: PassLoop, n: int) -> None:
        loop.check_integrity()
        computed.append(n)

    rep.run(((blocks.tokens(r), [0]) for r in reqs), after_pass=check)
    c = rep.counts
    too_long = sum(blocks.length(r) > 2048 for r in reqs)
    assert 0 < too_long < len(reqs) // 2 and c.rejected == too_long
    assert c.requests + c.rejected == len(reqs) == len(c.per_request) and c.passes == len(computed)
    assert max(computed) <= budget and all(n >= 0 for n in computed)
    assert sum(computed) >= c.prompt_tokens - c.hit_tokens  # retractions recompute: never fewer
    assert all(v > 0 for v in c.hit.values()), c.hit
    assert rep.holders == 0 and rep.device.num_free + rep.tree.cached_pages("device") == 2048 // 16


def test_policy_cli_writes_its_table_as_json(tmp_path, capsys):
    out = tmp_path / "policy.json"
    data = trace_replay.main(["policy", "--busiest", "4", "--count", "24", "--block-tokens", "64",
                              "--setups", "16k,8k+8k,8k+8k+16k", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(data))
    rows = data["setups"]
    assert set(rows) == {"16k", "8k+8k", "8k+8k+16k"}
    assert rows["8k+8k+16k"]["total_tokens"] == 32_000 and rows["8k+8k+16k"]["hit_tokens_storage"] > 0
    assert rows["8k+8k"]["hit_tokens_host"] > 0 and rows["16k"]["hit_tokens_host"] == 0
    for r in rows.values():
        assert 0 < r["hit_rate"] <= 1 and r["bookkeeping_us_per_request"] > 0 and r["rejected"] == 0
        assert r["vs_bound"] == pytest.approx(r["hit_rate"] / r["lru_bound"])
    assert "x bound@distinct" in capsys.readouterr().out


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="not a token count"):
        trace_replay.tokens_arg("lots")
    with pytest.raises(ValueError, match="L1\\[\\+L2"):
        trace_replay.parse_setup("1M+1M+1M+1M")
    with pytest.raises(ValueError, match="an L3 needs an L2"):
        PolicyConfig(1000, 0, 1000)
    with pytest.raises(ValueError, match="schedule_policy 'sjf'"):
        PolicyConfig(1000, schedule_policy="sjf")
    with pytest.raises(ValueError, match="use run"):
        PolicyReplay(PolicyConfig(1000, concurrency=2)).request(list(range(40)))
    with pytest.raises(ValueError, match="block_tokens"):
        BlockTokens(TRACE_BLOCK + 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: 1 hash ids for 2000 tokens"):
        load_trace(bad)
    with pytest.raises(SystemExit):
        trace_replay.main(["live", "--busiest", "1"])  # neither --url nor --serve


@pytest.fixture(scope="module")
def tiny_ctx2k(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and 2k positions."""
    return tiny_model(tmp_path_factory.mktemp("trace-tiny"), with_tokenizer=True)


@pytest.mark.slow
def test_live_replay_against_tiny_servers_matches_the_policy(tiny_ctx2k, tmp_path):
    """One command, two servers (L1 only; L1+L2+L3 with LMDB), 16 requests of the 8 busiest chains
    (8 tokens per hash id), one at a time, each once the server's L3 writes are done (--settle:
    the policy's assumption; a slow fsync on a loaded CI disk otherwise leaves L3 behind and
    the L3 hits at 0). L1 only: every response's hits are exactly what the policy replay
    predicts. L1+L2+L3: hits on every tier, never more than predicted, no write-back dropped,
    the server's integrity check passes."""
    out = tmp_path / "live.json"
    data = trace_replay.main([
        "live", "--serve", "--setups", "L1,L1+L2+L3", "--busiest", "8", "--count", "16", "--block-tokens", "8",
        "--concurrency", "1", "--settle", "--l2-ratio", "1", "--l3-gb", "0.05", "--l3-dir", str(tmp_path),
        "--server-args", f"--model-path {tiny_ctx2k} --max-total-tokens 1024 --device cpu",
        "--setup-args", "L1+L2+L3=--hicache-storage-load-policy always_load --hicache-storage-prefetch-threshold 16",
        "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(data))
    l1, l3 = data["setups"]["L1"], data["setups"]["L1+L2+L3"]
    for r in (l1, l3):
        assert r["exit_code"] == 0 and r["integrity_ok"], r
        m = r["measured"]
        assert m["requests"] == 16 and m["errors"] == 0 and m["skipped_too_long"] == 0, m
        assert m["ttft_p50_s"] > 0 and m["prompt_tok_s"] > 0
    assert l1["caps"]["l1_tokens"] == 1024 and l1["caps"]["l2_tokens"] == 0
    assert l3["caps"]["l2_tokens"] == 1024 and l3["caps"]["l3_tokens"] > 0
    tiers = ("hit_tokens_device", "hit_tokens_host", "hit_tokens_storage")
    assert {k: l1["measured"][k] for k in tiers} == {k: l1["predicted"][k] for k in tiers} != {k: 0 for k in tiers}
    m, p = l3["measured"], l3["predicted"]
    assert all(m[k] > 0 for k in tiers), m
    assert m["hit_tokens_device"] + m["hit_tokens_host"] + m["hit_tokens_storage"] <= p["hit_rate"] * m["prompt_tokens"]
    assert m["write_pages_dropped"] == 0 and m["pages_written"] > 0, m
    assert data["ttft_p50_speedup"] is not None and data["throughput_speedup"] is not None


@pytest.mark.slow
def test_live_replay_with_eight_in_flight_matches_the_pass_loop(tmp_path):
    """Eight requests in flight (a closed loop of 8 clients), L1 only: the server admits, chunks
    and orders them (chunked prefill, lpm), so they hit what one at a time would not; the policy
    replay's pass loop predicts the hits within 25 %: runs differ with when each response reaches
    its client, by a few % on an idle machine and up to 17 % beside another test worker on 2 cores
    (0.407 measured against 0.489 predicted in one CI run). The replay that ran each request in
    flight at its own pace predicted 0.29 where the server hits 0.46-0.49 (0.63x): out of bounds."""
    model = tiny_model(tmp_path / "model", vocab_size=32000, eos_token_id=31999, max_position_embeddings=8192)
    data = trace_replay.main([
        "live", "--serve", "--setups", "L1", "--busiest", "10", "--count", "120", "--block-tokens", "32",
        "--concurrency", "8", "--server-args", f"--model-path {model} --max-total-tokens 4096 --device cpu"])
    r = data["setups"]["L1"]
    assert r["exit_code"] == 0 and r["integrity_ok"] and r["measured"]["errors"] == 0, r
    assert r["caps"]["chunked_prefill_size"] == 2048 and r["caps"]["schedule_policy"] == "lpm"
    assert 0.75 <= r["hit_rate_vs_predicted"] <= 1.15, (r["measured"]["hit_rate"], r["predicted"]["hit_rate"])
