"""The KV pool's tensors: fixed-size blocks in segments that grow on demand and shrink from the tail.

A block holds K and V of ``block_size`` tokens for every layer (latent attention's one entry, its
latent and shared rotated key, in place of the two: ``ModelConfig.kv_layout``). Block ``b`` lives in segment
``b // segment_blocks``; segments form a prefix of the block map (lowest-free-first allocation
fills them in order, and only trailing free segments are released), so the pool's device
footprint is the segments it holds, not the blocks in use. With ``materialize=False`` the pool
keeps the same books and charges the same bytes but holds no tensors (a cost-model executor).
"""
from __future__ import annotations

import torch

from engine.config import ModelConfig, torch_dtype
from engine.device import Device

# Pool-wide ids (blocks, or token slots block * block_size + offset) grouped by the segment that
# holds them: (segment, where in the ids they sit (None: all of them), their rows in the segment).
Located = list[tuple[int, torch.Tensor | None, torch.Tensor]]


class KVPool:
    def __init__(self, model: ModelConfig, block_size: int, num_blocks: int, segment_blocks: int,
                 device: Device, materialize: bool = True) -> None:
        self.block_size, self.num_blocks = block_size, num_blocks
        self.configured_segment_blocks = segment_blocks
        self.segment_blocks = min(segment_blocks, num_blocks)
        self.device, self.materialize = device, materialize
        # what the blocks hold (an 8-bit float with ``ModelConfig.kv_cache_dtype``) and what attention reads them as
        self.dtype, self.compute_dtype = model.kv_dtype, torch_dtype(model.dtype)
        self.limit = torch.finfo(self.dtype).max if self.dtype != self.compute_dtype else None
        # each layer's K and V scales with an 8-bit KV cache ([layers, 2], float32: ``LlamaModel.kv_scales``),
        # None for 1: a value is stored as itself over its scale and read back times it
        self.scales: torch.Tensor | None = None
        entries, self.num_kv_heads, self.head_dim = model.kv_layout
        # [layers, K/V (or latent attention's one entry), blocks, block_size, kv_heads, head_dim]
        self.block_shape = (model.num_layers, entries, block_size, self.num_kv_heads, self.head_dim)
        self.block_bytes = model.kv_bytes_per_token() * block_size
        self.segments: list[torch.Tensor | None] = []

    # ---- footprint -------------------------------------------------------------------------
    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def held_blocks(self) -> int:
        return min(self.num_segments * self.segment_blocks, self.num_blocks)

    def footprint_bytes(self) -> int:
        return self.held_blocks * self.block_bytes

    def _segment_len(self, index: int) -> int:
        return min(self.segment_blocks, self.num_blocks - index * self.segment_blocks)

    def ensure(self, block_id: int) -> None:
        """Hold every segment up to the one ``block_id`` lives in; raises ``DeviceOOM`` and keeps
        what it had when the device cannot provide one."""
        while self.num_segments <= block_id // self.segment_blocks:
            n = self._segment_len(self.num_segments)
            L, two, bs, h, d = self.block_shape
            if self.materialize:
                seg = self.device.alloc("kv", (L, two, n, bs, h, d), self.dtype)
            else:
                self.device.charge("kv", n * self.block_bytes)
                seg = None
            self.segments.append(seg)

    def release_tail(self, highest_used: int) -> int:
        """Give back trailing segments above ``highest_used``; returns the bytes released."""
        keep = highest_used // self.segment_blocks + 1 if highest_used >= 0 else 0
        released = 0
        while self.num_segments > keep:
            nbytes = self._segment_len(self.num_segments - 1) * self.block_bytes
            self.segments.pop()
            self.device.release("kv", nbytes)
            released += nbytes
        if released and self.materialize:
            self.device.give_back()
        return released

    def release_all(self) -> None:
        self.release_tail(-1)

    def resize(self, num_blocks: int) -> None:
        """Hold at most ``num_blocks`` blocks from now on: what a restarted process sizes its pool
        to (a new memory limit). Only an empty pool can be resized."""
        if self.segments:
            raise AssertionError("only an empty KV pool can be resized")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.segment_blocks = min(self.configured_segment_blocks, num_blocks)

    # ---- data --------------------------------------------------------------------------------
    def locate(self, ids: torch.Tensor, rows_per_block: int = 1) -> Located:
        """Where pool-wide rows live: ``ids`` are block ids (``rows_per_block`` 1) or token slots
        (``rows_per_block`` = block_size). A step locates once; every layer reuses the answer."""
        if self.num_segments == 1:
            return [(0, None, ids)]
        rows = self.segment_blocks * rows_per_block
        seg_idx = torch.div(ids, rows, rounding_mode="floor")
        parts = []
        for s in torch.unique(seg_idx).tolist():
            where = torch.nonzero(seg_idx == s).flatten()
            parts.append((s, where, ids[where] - s * rows))
        return parts

    def _layer(self, segment: int, layer: int) -> torch.Tensor:
        """One layer of a segment as [K/V, blocks, block_size, kv_heads, head_dim], a view."""
        return self.segments[segment][layer]

    def _stored(self, x: torch.Tensor, layer: int, entry: int) -> torch.Tensor:
        """``x`` as the blocks hold it: in an 8-bit float over its layer's scale (``scales``; 1 where there are
        none), in float32, saturated at the format's largest value (vLLM's conversion), or as it is."""
        if self.limit is None:
            return x
        if self.scales is not None:
            x = x.float() / self.scales[layer, entry]
        return x.clamp(-self.limit, self.limit).to(self.dtype)

    def _read(self, kv: torch.Tensor, layer: int) -> torch.Tensor:
        """Gathered K and V ([K/V, ...]) in the model's dtype: 8-bit values times their layer's scales."""
        if self.scales is None:
            return kv.to(self.compute_dtype)
        return (kv.float() * self.scales[layer].view((-1,) + (1,) * (kv.dim() - 1))).to(self.compute_dtype)

    def write_slots(self, layer: int, slots: Located, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Store K and V of new tokens ([tokens, kv_heads, head_dim]) at slots ``locate``d with
        ``rows_per_block`` = block_size; ``v`` None where the pool holds one entry a token (latent attention's)."""
        k, v = self._stored(k, layer, 0), None if v is None else self._stored(v, layer, 1)
        for s, where, rows in slots:
            kv = self._layer(s, layer).flatten(1, 2)  # [K/V, slots, kv_heads, head_dim]
            _raw(kv[0]).index_copy_(0, rows, _raw(k if where is None else k[where]))
            if v is not None:
                _raw(kv[1]).index_copy_(0, rows, _raw(v if where is None else v[where]))

    def gather_blocks(self, layer: int, blocks: Located, n: int) -> torch.Tensor:
        """K and V of ``n`` blocks ``locate``d with ``rows_per_block`` = 1, in their order, as
        [K/V, n, block_size, kv_heads, head_dim] in the model's dtype: one copy (index_select) per segment touched
        (and one more where the blocks hold 8-bit floats, read back times their scales)."""
        if len(blocks) == 1 and blocks[0][1] is None:
            s, _, rows = blocks[0]
            return self._read(self._layer(s, layer).index_select(1, rows), layer)
        out = torch.empty((self.block_shape[1], n) + self.block_shape[2:], dtype=self.dtype,
                          device=self.device.torch_device)
        for s, where, rows in blocks:
            _raw(out).index_copy_(1, where, _raw(self._layer(s, layer).index_select(1, rows)))
        return self._read(out, layer)

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V of new tokens ([tokens, kv_heads, head_dim]) at (block, offset) slots."""
        self.write_slots(layer, self.locate(blocks * self.block_size + offsets, self.block_size), k, v)

    def gather(self, layer: int, block_table: torch.Tensor) -> torch.Tensor:
        """K and V of the blocks in ``block_table`` ([..., n]) as [K/V, ..., n * block_size, kv_heads, head_dim]."""
        flat = block_table.reshape(-1)
        out = self.gather_blocks(layer, self.locate(flat), flat.numel())
        lead = tuple(block_table.shape[:-1])
        return out.reshape((self.block_shape[1],) + lead + (block_table.shape[-1] * self.block_size, self.num_kv_heads, self.head_dim))

    def read_blocks(self, ids: list[int]) -> torch.Tensor:
        """Whole blocks (every layer, K and V) as [n, layers, K/V, block_size, kv_heads, head_dim]."""
        if not ids or not self.materialize:  # shape and bytes without data
            return torch.empty((len(ids),) + self.block_shape, dtype=self.dtype, device="meta")
        idx = torch.tensor(ids, dtype=torch.long, device=self.device.torch_device)
        data = torch.empty((len(ids),) + self.block_shape, dtype=self.dtype, device=self.device.torch_device)
        for s, where, rows in self.locate(idx):
            blocks = self.segments[s].index_select(2, rows).permute(2, 0, 1, 3, 4, 5)
            if where is None:
                data.copy_(blocks)
            else:
                _raw(data)[where] = _raw(blocks)
        return data

    def write_blocks(self, ids: list[int], data: torch.Tensor) -> None:
        """Store whole blocks ([n, layers, K/V, block_size, kv_heads, head_dim]) at ``ids``."""
        if not self.materialize:
            return
        data = data.to(self.device.torch_device, non_blocking=True).permute(1, 2, 0, 3, 4, 5)
        idx = torch.tensor(ids, dtype=torch.long, device=self.device.torch_device)
        for s, where, rows in self.locate(idx):
            _raw(self.segments[s]).index_copy_(2, rows, _raw(data if where is None else data[:, :, where]))

    def copy_blocks(self, moves: list[tuple[int, int]]) -> None:
        """Copy each source block's data to its destination (compaction). Sources and destinations
        are disjoint, so the copies may run in any order and need no staging buffer.

        Moves whose sources and destinations both run consecutively (within one segment each) go
        as one slice copy over every layer, so each byte moves once. A batched index_select +
        index_copy_ moves every byte twice through a staging tensor the size of the move, and
        measured 2x (buffer reused) to 10x (fresh buffer: page faults) slower on CPU."""
        if not moves or not self.materialize:
            return
        S = self.segment_blocks
        for src, dst, n in _runs(sorted(moves), S):
            (ss, so), (ds, do) = divmod(src, S), divmod(dst, S)
            self.segments[ds][:, :, do:do + n].copy_(self.segments[ss][:, :, so:so + n])


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes where it holds 8-bit floats (PyTorch's CPU index_copy_ takes no float8 tensor), else ``t``."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _runs(moves: list[tuple[int, int]], segment_blocks: int) -> list[tuple[int, int, int]]:
    """(first source, first destination, length) of each maximal run of moves with consecutive
    sources and consecutive destinations that crosses no segment boundary on either side."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in moves:
        if runs:
            s0, d0, n = runs[-1]
            if src == s0 + n and dst == d0 + n and src % segment_blocks and dst % segment_blocks:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs
