"""Fields other serving APIs define that HiCache accepts only at their neutral value.

SGLang's own clients (``sglang.bench_serving``, its SDK) send every field of its
``GenerateReqInput`` / ``SamplingParams`` (0.5.x) with its default, and OpenAI SDKs send
fields of the OpenAI API reference. A field HiCache implements is a declared field of its
request model; a field it does not implement is listed here with the values that leave the
answer unchanged: it is accepted (and dropped) at such a value, ``null`` included, and a 400
naming it otherwise. ``ANY`` marks fields that cannot change the answer (labels, tracing,
routing hints): accepted with any value. A field in no table stays unknown: a 400.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

ANY = ("<any>",)  # sentinel: every value is neutral

# SGLang 0.5.x SamplingParams fields that HiCache does not implement
SAMPLING: Mapping[str, tuple[Any, ...]] = {
    "min_new_tokens": (0,),
    "n": (1,),  # /generate handles n itself (serving.server.native_api); the engine never sees it
    "beam_width": (1,),
    "spaces_between_special_tokens": (True,),
    "no_stop_trim": (False,),
    "stream_interval": ANY,  # how often a stream is flushed, not what it says
    "logit_bias": ({},),
    "custom_params": ({},),
    "watermark": (),
    "stop_regex": ((), []),
}

# SGLang 0.5.x GenerateReqInput fields that HiCache does not implement (/generate)
GENERATE: Mapping[str, tuple[Any, ...]] = {
    "input_embeds": (),
    "image_data": ((), []),
    "video_data": ((), []),
    "audio_data": ((), []),
    "mm_hashes": (),
    "mm_content_hashes": (),
    "use_audio_in_video": (False,),
    "video_config": (),
    "watermark": (),
    "return_sampling_mask": (False,),
    "sampling_logprobs_mode": (),
    "return_flat_raw_top_logprobs": (False,),
    "return_flat_raw_output_top_logprobs": (False,),
    "return_flat_raw_top_logprobs_b64": (False,),
    "log_metrics": ANY,
    "return_hidden_states": (False,),
    "return_routed_experts": (False,),
    "routed_experts_start_len": (0,),
    "return_indexer_topk": (False,),
    "modalities": ((), [], ["text"]),
    "session_params": (),
    "lora_id": (),
    "custom_logit_processor": (),
    "positional_embed_overrides": (),
    "bootstrap_pair_key": ANY,
    "decode_tp_size": ANY,
    "routed_dp_rank": ANY,
    "data_parallel_rank": ANY,
    "disagg_prefill_dp_rank": ANY,
    "routing_key": ANY,
    "conversation_id": ANY,
    "http_worker_ipc": ANY,
    "background": (False,),
    "require_reasoning": (False,),
    "max_thinking_tokens": (),
    "priority": ANY,
    "extra_key": (),
    "no_logs": ANY,
    "custom_labels": ANY,
    "return_bytes": (False,),
    "return_entropy": (False,),
    "return_prompt_token_ids": (False,),
    "external_trace_header": ANY,
    "received_time": ANY,
    "need_wait_for_mm_inputs": (False,),
    "num_items_assigned": (),
    "encoder_urls": ((), []),
    "max_dynamic_patch": (),
    "min_dynamic_patch": (),
    "image_max_dynamic_patch": (),
    "video_max_dynamic_patch": (),
    "images_config": (),
    "mm_processor_kwargs": ({},),
    "multi_item_delimiter_indices": (),
    "token_indices_to_pool": (),
    "kv_hints": ANY,
    "cache_salt": (),
}

# OpenAI API reference + SGLang's OpenAI-route extras, both /v1 routes
_OPENAI_COMMON: Mapping[str, tuple[Any, ...]] = {
    "metadata": ANY,  # labels stored with the completion on OpenAI's side
    "store": (False,),
    "service_tier": ("auto", "default"),
    "prompt_cache_key": ANY,  # a caching hint (HiCache caches every prefix anyway)
    "safety_identifier": ANY,
    "return_hidden_states": (False,),
    "return_routed_experts": (False,),
    "routed_experts_start_len": (0,),
    "return_cached_tokens_details": (False,),
    "return_spec_tokens_details": (False,),
    "return_token_ids": (False,),
    "min_tokens": (0,),
    "stop_regex": ((), []),
    "no_stop_trim": (False,),
    "lora_path": (),
    "session_params": (),
    "custom_params": ({},),
    "custom_logit_processor": (),
    "watermark": (),
    "images_config": (),
    "mm_processor_kwargs": ({},),
    "data_parallel_rank": ANY,
    "rid": (),
    "extra_key": (),
    "priority": ANY,
    "custom_labels": ANY,
    "cache_salt": (),
}

CHAT: Mapping[str, tuple[Any, ...]] = {
    **_OPENAI_COMMON,
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "verbosity": (),
    "functions": ((), []),
    "function_call": ("none", "auto"),
    "return_prompt_token_ids": (False,),
    "return_meta_info": (False,),
    "return_input_ids_in_sglext": (False,),
    "return_output_ids_in_sglext": (False,),
    "return_sampling_mask": (False,),
    "sampling_logprobs_mode": (),
    "return_flat_raw_output_top_logprobs": (False,),
    "return_flat_raw_top_logprobs_b64": ANY,  # only shapes the flat raw logprobs (off)
    "thinking": (),
    "task": (),
    "continue_final_message": (False,),
    "stream_reasoning": ANY,
    "max_dynamic_patch": (),
    "min_dynamic_patch": (),
    "use_audio_in_video": (False,),
    "video_config": (),
    "input_ids": (),
}

COMPLETION: Mapping[str, tuple[Any, ...]] = {
    **_OPENAI_COMMON,
    "json_schema": (),
}

# a chat message's fields beyond role / content / name
MESSAGE: Mapping[str, tuple[Any, ...]] = {
    "tool_calls": ((), []),
    "reasoning_content": ANY,  # an earlier turn's reasoning; the chat template drops it
    "refusal": (),
    "audio": (),
    "annotations": ANY,
}


def _same(value: Any, neutral: Any) -> bool:
    # ``False == 0`` in Python; a neutral bool must be given as a bool and vice versa
    return type(value) is type(neutral) and value == neutral or (
        isinstance(value, list | tuple) and isinstance(neutral, list | tuple) and list(value) == list(neutral)
    )


def is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    if value is None or neutral is ANY:
        return True
    if isinstance(value, float) and any(type(n) is int and not isinstance(n, bool) and value == n for n in neutral):
        return True
    return any(_same(value, n) for n in neutral)


def describe(neutral: tuple[Any, ...]) -> str:
    values = ["null", *(_json(n) for n in neutral)]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]


def _json(v: Any) -> str:
    import json

    return json.dumps(list(v) if isinstance(v, tuple) else v)


def drop_neutral(data: Any, table: Mapping[str, tuple[Any, ...]], declared: Collection[str]) -> Any:
    """``data`` without the table's fields that carry a neutral value. Raises ValueError
    ("field: ...") for one set to anything else; unknown fields are left for the model to refuse."""
    if not isinstance(data, dict):
        return data
    out = {}
    for key, value in data.items():
        neutral = table.get(key) if key not in declared else None
        if neutral is None:
            out[key] = value
        elif not is_neutral(value, neutral):
            raise ValueError(f"{key}: not supported by HiCache; accepted only as {describe(neutral)}")
    return out
