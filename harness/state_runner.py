"""Drive a model with state layers directly (no engine): its KV pool, its state pool, the torch
attention backend and the page / slot bookkeeping of a few sequences, as tests/models/test_models.py
drives Llama; and the HF reference checkpoint the hybrid family tests compare with
(tests/models/test_qwen3_5.py, test_nemotron_h.py)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from hicache.tiers.device import DeviceKVPool, KVLayout
from hicache.tiers.state_pool import DeviceStatePool
from serving.kernels.attention import get_attention_backend
from serving.models.loader import load_model
from serving.structs.forward_batch import ForwardBatch

PAGE_SIZE = 4


def hf_checkpoint(path: Path, arch: str, **overrides) -> tuple[Path, torch.nn.Module]:
    """A tiny random ``arch`` checkpoint (harness/model_utils.py tiny_model) with every norm, gate and
    decay parameter moved off its init (HF starts norms at 1 or 0 and dt_bias / D at 1, which would
    hide a wrong formula), saved again; returns (path, the HF model in fp32 eval mode)."""
    from transformers import AutoModelForCausalLM

    from harness.model_utils import tiny_model

    tiny_model(path, arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", ".D", "A_log", "conv1d.bias")):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(path)
    return path, hf


def hf_last_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


class StateRunner:
    """Our model + KV pool + state pool for a few sequences (page ids shuffled, slot 0 left unused)."""

    def __init__(self, path: Path, num_pages: int = 256, num_slots: int = 24) -> None:
        self.model, self.cfg = load_model(path)
        stack = self.model.layer_stack
        layout = KVLayout(len(stack.kv_layers), self.cfg.num_key_value_heads, self.cfg.head_dim, torch.float32)
        self.kv = DeviceKVPool(layout, num_pages, PAGE_SIZE, "cpu")
        self.state = DeviceStatePool(self.model.state_layout(torch.float32), num_slots, "cpu")
        self.state.alloc(1)  # slot 0: never a sequence's (a bug reading slot 0 shows)
        self.attn = get_attention_backend("torch")
        self.free = list(range(1, num_pages))
        random.Random(0).shuffle(self.free)
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.slots: dict[int, int] = {}

    def new_slot(self) -> int:
        slot = self.state.alloc(1)[0]
        self.state.zero_slot(slot)
        return slot

    def fork(self, sid: int, parent: int, tokens: int, snap_slot: int) -> None:
        """Sequence ``sid`` starts as ``parent``'s first ``tokens`` (a page multiple: its pages are
        shared, as the tree shares them) with the state of ``snap_slot`` restored into a fresh slot
        through the host (``read_slot`` / ``write_slot``, what a lower tier gives back)."""
        assert tokens % PAGE_SIZE == 0
        self.pages[sid] = list(self.pages[parent][: tokens // PAGE_SIZE])
        self.lens[sid] = tokens
        self.slots[sid] = slot = self.state.alloc(1)[0]
        self.state.write_slot(slot, self.state.read_slot(snap_slot))

    def step(self, new: dict[int, list[int]], snaps: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
        """Run ``new`` token ids of each sequence id on top of its cache; ``snaps``: sequence id ->
        offset of the new token after which its state is captured (slot in ``self.snapped[sid]``)."""
        seqs, slots, snap_slots, snap_offsets = [], [], [], []
        self.snapped: dict[int, int] = {}
        for sid, ids in new.items():
            prefix = self.lens.get(sid, 0)
            pages = self.pages.setdefault(sid, [])
            while len(pages) * PAGE_SIZE < prefix + len(ids):
                pages.append(self.free.pop())
            seqs.append((ids, prefix, list(pages)))
            self.lens[sid] = prefix + len(ids)
            if sid not in self.slots:
                self.slots[sid] = self.new_slot()
            slots.append(self.slots[sid])
            off = (snaps or {}).get(sid, -1)
            if off >= 0:
                self.snapped[sid] = self.state.alloc(1)[0]
            snap_slots.append(self.snapped.get(sid, -1))
            snap_offsets.append(off)
        batch = ForwardBatch.build(seqs, PAGE_SIZE, state_slots=slots, snap_slots=snap_slots,
                                   snap_offsets=snap_offsets)
        logits = self.model(batch, self.kv, self.attn, self.state)
        assert logits.dtype == torch.float32 and logits.shape == (len(new), self.cfg.vocab_size)
        return dict(zip(new, logits, strict=True))
