"""Frozen configs of the engine's components; composed into EngineConfig.

Flag names follow SGLang's server arguments where one exists (``--max-running-requests``,
``--chunked-prefill-size``, ``--schedule-policy``, ``--max-total-tokens``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache.config import CacheConfig
from hicache.config_fields import check_choices, choice

KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8", "fp8_e4m3")  # serving.runner.model_runner.KV_CACHE_DTYPES
QUANTIZATIONS = ("none", "auto", "int8", "int4", "fp8")  # none, auto + serving.models.quant.quant_methods()
DTYPES = ("auto", "float32", "bfloat16", "float16")  # "auto" + serving.runner.model_runner.DTYPES
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # serving.models.loader.LOAD_FORMATS
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")  # "auto" + serving.kernels.attention.ATTENTION_BACKENDS
GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "none")
SPECULATIVE_ALGORITHMS = ("NGRAM",)  # serving.speculative.ALGORITHMS
SCHEDULE_POLICIES = ("fcfs", "lpm")  # serving.scheduler.schedule_policy.SCHEDULE_POLICIES


@dataclass(frozen=True)
class ModelConfig:
    model_path: str = "models/SmolLM2-135M-Instruct"  # a Hugging Face model folder (config.json, safetensors)
    dtype: str = choice("auto", DTYPES)  # auto: float32 on CPU, bfloat16 on CUDA
    load_format: str = choice("auto", LOAD_FORMATS)  # dummy: random weights of the config's shape
    device: str = "auto"  # auto (cuda when available, else cpu) | cpu | cuda | cuda:N
    # auto: triton on CUDA; on CPU cpu (C++, AVX-512) where it builds, else torch
    attention_backend: str = choice("auto", ATTENTION_BACKENDS)
    context_length: int | None = None  # default: the model's max_position_embeddings
    tokenizer_path: str | None = None  # default: model_path
    served_model_name: str | None = None  # the name clients pass as "model" (default: the model path)
    random_seed: int = 0  # seeds sampling and dummy weights
    disable_cuda_graph: bool = False  # CUDA: decode batches replay captured graphs unless set
    cuda_graph_max_bs: int = 64  # largest decode batch captured (larger batches run eagerly)
    # CUDA: extend (prefill) batches of up to this many new tokens replay captured graphs too
    # (serving/runner/cuda_graph_extend.py; at most cuda_graph_max_bs sequences); disable_cuda_graph turns
    # them off as well. Default: 256, or 1024 for a model with sliding-window or state layers
    # (extend_token_budget)
    cuda_graph_max_extend_tokens: int | None = None
    disable_extend_cuda_graph: bool = False  # CUDA: extend batches run eagerly (decode graphs stay)
    tp_size: int = 1  # tensor parallelism (--tp-size / --tensor-parallel-size): one process per rank
    dist_timeout: float = 300.0  # seconds a collective or a rank's reply may take before the engine stops
    kv_cache_dtype: str = choice("auto", KV_CACHE_DTYPES)  # L1's KV dtype (vLLM/SGLang flag); auto: the model's
    quantization: str = "none"  # weights (vLLM/SGLang flag): none | int8 | int4 (CPU) | fp8 (CUDA sm89+)

    def __post_init__(self) -> None:
        check_choices(self)  # dtype, load_format, attention_backend, kv_cache_dtype
        kind, _, index = self.device.partition(":")
        if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.context_length is not None and self.context_length <= 0:
            raise ValueError("context_length must be positive")
        if self.cuda_graph_max_bs <= 0:
            raise ValueError("cuda_graph_max_bs must be positive")
        if self.cuda_graph_max_extend_tokens is not None and self.cuda_graph_max_extend_tokens <= 0:
            raise ValueError("cuda_graph_max_extend_tokens must be positive (disable_extend_cuda_graph turns them off)")
        if self.tp_size < 1:
            raise ValueError("tp_size must be at least 1")
        if not self.dist_timeout > 0:
            raise ValueError("dist_timeout must be positive")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64  # requests decoded together at most
    chunked_prefill_size: int = 2048  # prefill tokens per step; -1 disables chunking
    schedule_policy: str = choice("lpm", SCHEDULE_POLICIES)  # lpm: longest cached prefix first
    # L1 KV capacity in tokens; default from kv_cache_gb, else the GPU's free memory (CPU: 16384 tokens);
    # more than the GPU (CPU: the host) has free is an error
    max_total_tokens: int | None = None
    kv_cache_gb: float | None = None  # L1 KV capacity in GiB (alternative to max_total_tokens)
    mem_fraction_static: float = 0.85  # CUDA: share of free GPU memory for weights + KV
    # Models with recurrent-state layers (SGLang's name): L1 state slots, 3 per running request (its working
    # slot, 2 captures) and the tree's snapshots; default 4 per running request + 8, their bytes within
    # mamba_full_memory_ratio of the KV cache's (on CUDA sized by budget: that share of the budget)
    max_mamba_cache_size: int | None = None
    # the default state slots' bytes at most this times the KV cache's (SGLang's name)
    mamba_full_memory_ratio: float = 0.9
    # Models with sliding-window layers: keep their KV in L1 only where a window can still read it (a window
    # pool beside the full layers' pages; opt-in for now: no TP / PD, see docs/models.md)
    enable_hybrid_swa_memory: bool = False
    # the window pool's tokens per token of the full layers' pages (SGLang's name)
    swa_full_tokens_ratio: float = 0.8
    # keep the sliding layers' KV for every cached token, as the full layers' (SGLang's name; the default now)
    disable_hybrid_swa_memory: bool = False
    max_queued_requests: int = 1024  # waiting requests beyond this are refused (HTTP 429)
    grammar_backend: str = choice("xgrammar", GRAMMAR_BACKENDS)  # structured output: xgrammar, llguidance or none
    jump_forward: bool = True  # append grammar-forced tokens without a forward pass each
    # Grammar budgets (serving/grammar/compile_pool.py). A grammar compiles off the scheduler thread
    # while its request waits in the queue; past the time budget its trial compile (in a worker process)
    # is killed and the request fails with a 400 naming the budget. Legitimate grammars compile in
    # milliseconds to ~1 s; a 600-byte regex can take minutes.
    grammar_compile_timeout_s: float = 10.0
    grammar_max_bytes: int = 32768  # a json_schema / regex / ebnf text over this is a 400 at once
    grammar_compile_workers: int = 2  # worker processes for trial compiles (started with the first grammar)
    grammar_max_pending_compiles: int = 128  # distinct grammars queued or compiling; beyond: 429
    # memory (RSS) a trial compile may add to its worker process; past it the worker is killed and
    # the request fails with a 400 naming the limit (legitimate grammars: a few MB)
    grammar_compile_max_memory_mb: int = 1024
    # one jump-forward look-ahead (on the scheduler thread) stops at this many tokens or this long;
    # the request goes on without it (a grammar may force an infinite string: root ::= "ab" root)
    grammar_jump_forward_max_tokens: int = 256
    grammar_jump_forward_max_ms: float = 20.0  # the time budget of one jump-forward look-ahead (above)
    disable_overlap_schedule: bool = False  # CUDA: prepare batch N+1 while the GPU runs batch N
    # Speculative decoding (SGLang's flags; serving/speculative). NGRAM: each running request's last
    # tokens are matched against the token sequences the HiRadixTree holds (any tier) and its own prompt
    # and output; the continuation is verified in one forward pass (unset: off)
    speculative_algorithm: str | None = choice(None, SPECULATIVE_ALGORITHMS, optional=True)
    # tokens verified per request and step, as in SGLang: its last token and up to this many minus one drafts
    speculative_num_draft_tokens: int = 9
    speculative_ngram_min_match_window_size: int = 2  # the shortest suffix of a request that drafts
    speculative_ngram_max_match_window_size: int = 12  # suffix tokens compared to rank the matches
    # which match drafts: BFS the most recent one, PROB the continuation seen most often
    speculative_ngram_match_type: str = choice("BFS", ("BFS", "PROB"))
    # positions the tree's n-gram index holds (~220 bytes each, 3 per token: ~110 MiB); least recently used go first
    speculative_ngram_capacity: int = 1 << 19

    def __post_init__(self) -> None:
        check_choices(self)  # schedule_policy, grammar_backend, speculative_algorithm, speculative_ngram_match_type
        if self.speculative_num_draft_tokens < 2:
            raise ValueError("speculative_num_draft_tokens must be at least 2 (the last token and one draft)")
        if not 1 <= self.speculative_ngram_min_match_window_size <= self.speculative_ngram_max_match_window_size:
            raise ValueError("speculative_ngram_min_match_window_size must be in [1, "
                             "speculative_ngram_max_match_window_size]")
        if self.speculative_ngram_capacity <= 0:
            raise ValueError("speculative_ngram_capacity must be positive")
        if self.max_running_requests <= 0:
            raise ValueError("max_running_requests must be positive")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError("chunked_prefill_size must be positive or -1 (off)")
        if self.max_total_tokens is not None and self.max_total_tokens <= 0:
            raise ValueError("max_total_tokens must be positive")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be positive, got {self.kv_cache_gb}")
        if self.max_mamba_cache_size is not None and self.max_mamba_cache_size < 4:
            raise ValueError("max_mamba_cache_size must be at least 4 (a running request's 3 state slots and a "
                             f"snapshot), got {self.max_mamba_cache_size}")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got {self.swa_full_tokens_ratio}")
        if not self.mamba_full_memory_ratio > 0:
            raise ValueError(f"mamba_full_memory_ratio must be positive, got {self.mamba_full_memory_ratio}")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError("grammar_compile_timeout_s must be positive")
        if not self.grammar_jump_forward_max_ms > 0:
            raise ValueError("grammar_jump_forward_max_ms must be positive")
        for name in ("grammar_max_bytes", "grammar_compile_workers", "grammar_max_pending_compiles",
                     "grammar_compile_max_memory_mb", "grammar_jump_forward_max_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.model.kv_cache_dtype.startswith("fp8") and self.cache.kv_round_trip != "raw":
            raise ValueError(f"hicache_l2/l3_encoding {self.cache.kv_round_trip!r} needs a 16- or 32-bit L1; with "
                             f"kv_cache_dtype {self.model.kv_cache_dtype} the lower tiers keep L1's fp8 bytes as "
                             "they are (raw)")
