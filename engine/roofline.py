"""Deployments worth replaying, and a roofline cost model built from datasheet figures.

A roofline model is a model, not a measurement: an iteration takes a fixed overhead plus the
longer of its arithmetic at the device's peak FLOP/s and its memory traffic at the device's
memory bandwidth, each derated by a stated attainable fraction. Copies within the device read
and write each byte at the memory bandwidth; swaps cross the host link (PCIe) at its bandwidth.

The deployments are the memory-bound ones of docs/design.md ("Deployments"). Each
sizes its KV capacity as vLLM does: the engine's share of device memory
(``gpu_memory_utilization``) minus weights and the activation workspace of a full batch, in
blocks; the device itself is the whole GPU, so a co-tenant can take the rest and more.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from engine.config import KV_CACHE_DTYPES, EngineConfig, ModelConfig
from engine.cost_model import LINKS
from engine.scheduler import BatchShape

GB = 10**9


@dataclass(frozen=True)
class GPU:
    """Datasheet figures (dense, no sparsity; host link per direction)."""

    name: str
    memory_bytes: int
    memory_bytes_per_s: float
    peak_flops: float          # 16-bit tensor-core FLOP/s
    host_bytes_per_s: float    # host link, one direction


H100_SXM_80GB = GPU("NVIDIA H100 SXM 80GB", 80 * GB, 3.35e12, 989e12, 64e9)     # HBM3, PCIe Gen5 x16
H200_SXM_141GB = GPU("NVIDIA H200 SXM 141GB", 141 * GB, 4.8e12, 989e12, 64e9)   # HBM3e, PCIe Gen5 x16
A10_24GB = GPU("NVIDIA A10 24GB", 24 * GB, 600e9, 125e12, 32e9)                # GDDR6, PCIe Gen4 x16
L40S_48GB = GPU("NVIDIA L40S 48GB", 48 * GB, 864e9, 362e12, 32e9)              # GDDR6, PCIe Gen4 x16


@dataclass(frozen=True)
class RooflineCostModel:
    """``iteration_s`` and ``copy_s`` as ``CostModel`` has them, from ``gpu``'s datasheet.

    FLOPs of an iteration: 2 per parameter per batched token (the embedding lookup excluded,
    the LM head counted for every token) plus 4 x layers x heads x head_dim per attended
    (query, key) pair. Latent attention's pairs cost what vLLM computes: a decode's on the latent
    (``ModelConfig.pair_flops``), a prefill's on each head's keys and values projected from it
    (``prefill_pair_flops``, 3.4x less for DeepSeek's shapes). An iteration's shape does not tell its
    decodes from its chunks, so its ``context_tokens`` pairs (each sequence's last query's: a decode's only
    one) are charged the first way and the rest (``attended`` - ``context_tokens``) the second; a chunk's last
    query, which vLLM prefills, is the error, one row of the chunk's. Left out: vLLM projects a chunked
    prefill's earlier context from its latents again for every chunk (2 x kv_lora_rank x heads x
    (qk_nope_head_dim + v_head_dim) FLOPs a context token and layer), about a tenth more for a 2,048-token
    chunk at a 32k context, and hidden where the iteration is bound by memory.
    Bytes: the weights once, plus the KV each sequence reads and writes.

    An encoder beside the decoder (a multimodal checkpoint's vision tower) is never read for text.
    A layer that attends through a sliding window (``window``) reads and scores only the keys within
    it, as vLLM's kernels do, and a chunked one (``window_chunked``: Llama 4's) those of its chunk: the
    iteration's shape as it sees it comes as ``windowed``.
    A mixture of experts counts the parameters a token passes through (its ``experts_per_token``
    experts and the router) for FLOPs, and reads the experts its tokens pick: with n tokens
    routed independently and evenly, E x (1 - (1 - k / E)^n) of a layer's E experts, so a decode
    step of one sequence reads k experts a layer and a large batch reads them all.
    """

    gpu: GPU
    model: ModelConfig
    overhead_s: float = 2e-3        # per iteration: scheduling, launches (stated)
    flops_efficiency: float = 0.6   # attainable share of peak FLOP/s (stated)
    memory_efficiency: float = 0.8  # attainable share of memory and link bandwidth (stated)
    copy_fixed_s: float = 20e-6     # per copy call (stated)
    source: str = "roofline"

    def __post_init__(self) -> None:
        for name in ("flops_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.overhead_s < 0 or self.copy_fixed_s < 0:
            raise ValueError("overhead_s and copy_fixed_s must be >= 0")
        # the model's and the device's figures every iteration reads, worked out once (all of
        # them frozen): the same integers and products ``iterations_s`` used to form each call
        m = self.model
        matmul_params = m.param_count(active=True) - m.vocab_size * m.hidden_size * (0 if m.tie_word_embeddings else 1)
        expert_bytes = m.routed_expert_bytes()
        for name, value in (("_token_flops", 2 * matmul_params), ("_pair_flops", m.num_layers * m.pair_flops()),
                            ("_prefill_pair_flops", m.num_layers * m.prefill_pair_flops()),
                            ("_weight_bytes", m.weight_bytes() - expert_bytes - m.encoder_bytes()), ("_expert_bytes", expert_bytes),
                            ("_expert_unpicked", 1.0 - m.experts_per_token / m.num_experts if m.num_experts else 1.0),
                            ("_kv_token_bytes", m.kv_bytes_per_token()),
                            ("_window", m.sliding_window if m.window_layers else None),
                            ("_windowed_kv_bytes", m.kv_bytes_per_token() // m.num_layers * len(m.window_layers)),
                            ("_windowed_pair_flops", len(m.window_layers) * m.pair_flops()),
                            ("_flops_per_s", self.gpu.peak_flops * self.flops_efficiency),
                            ("_bytes_per_s", self.gpu.memory_bytes_per_s * self.memory_efficiency)):
            object.__setattr__(self, name, value)

    @property
    def window(self) -> int | None:
        """The sliding window the model's windowed layers attend through; None without one."""
        return self._window

    @property
    def window_chunked(self) -> bool:
        """Whether those layers attend within aligned chunks of ``window`` keys (Llama 4's), not the last ``window``."""
        return self.model.window_chunked

    def iteration_s(self, shape: BatchShape, windowed: BatchShape | None = None) -> float:
        """``shape``'s duration; ``windowed``: the same iteration as a windowed layer sees it (None: as
        ``shape``)."""
        if windowed is None:
            return float(self.iterations_s(shape.num_tokens, shape.context_tokens, shape.attended))
        return float(self.iterations_s(shape.num_tokens, shape.context_tokens, shape.attended,
                                       windowed.context_tokens, windowed.attended))

    def iterations_s(self, num_tokens, context_tokens, attended, windowed_context=None, windowed_attended=None):
        """``iteration_s`` elementwise: each argument an int or an array of ints (a run of decode
        iterations, engine/decode_run.py), with the same arithmetic, so the same durations. The
        windowed layers' keys and pairs past their window (``windowed_*``: what they read and score)
        are taken off the whole-context figures."""
        if self._prefill_pair_flops == self._pair_flops:
            flops = self._token_flops * num_tokens + self._pair_flops * attended
        else:  # every sequence's last query (context_tokens pairs) as a decode, the rest as a prefill
            flops = (self._token_flops * num_tokens + self._pair_flops * context_tokens
                     + self._prefill_pair_flops * (np.asarray(attended) - context_tokens))
        nbytes = self._weight_bytes + self._kv_token_bytes * (context_tokens + num_tokens)
        if windowed_context is not None and self._window is not None:
            flops = flops - self._windowed_pair_flops * (attended - windowed_attended)
            nbytes = nbytes - self._windowed_kv_bytes * (context_tokens - windowed_context)
        if self._expert_bytes:  # the share of experts the iteration's tokens pick
            nbytes = nbytes + self._expert_bytes * (1.0 - self._expert_unpicked ** np.asarray(num_tokens))
        compute = flops / self._flops_per_s
        memory = nbytes / self._bytes_per_s
        return self.overhead_s + np.maximum(compute, memory)

    def copy_s(self, nbytes: int, link: str = "device") -> float:
        if link not in LINKS:
            raise ValueError(f"link must be one of {LINKS}, got {link!r}")
        if not nbytes:
            return 0.0
        if link == "device":  # read and write every byte
            return self.copy_fixed_s + 2 * nbytes / (self.gpu.memory_bytes_per_s * self.memory_efficiency)
        return self.copy_fixed_s + nbytes / (self.gpu.host_bytes_per_s * self.memory_efficiency)

    def describe(self) -> str:
        return (f"roofline model of {self.gpu.name} (datasheet figures, {self.flops_efficiency:g} of peak FLOP/s, "
                f"{self.memory_efficiency:g} of bandwidth, {1e3 * self.overhead_s:g} ms per iteration)")


@dataclass(frozen=True)
class Deployment:
    """A model on a GPU: the engine's configuration and its roofline clock."""

    name: str
    gpu: GPU
    model: ModelConfig
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    restart_downtime_s: float = 60.0  # reloading tens of GB of weights and warming up
    notes: tuple[str, ...] = ()  # what the sizing leaves out (a checkpoint's sliding window), said with it

    def kv_bytes(self) -> int:
        per_layer_kv = self.model.kv_bytes_per_token() // self.model.num_layers
        workspace = (self.max_num_batched_tokens * self.model.workspace_bytes_per_token()
                     + self.max_model_len * per_layer_kv)
        kv = int(self.gpu.memory_bytes * self.gpu_memory_utilization) - self.model.weight_bytes() - workspace
        need = self.max_model_len * self.model.kv_bytes_per_token()
        if kv < need:
            usable = self.gpu.memory_bytes * self.gpu_memory_utilization
            left = f"{kv / GB:.1f} GB is left for KV" if kv > 0 else "nothing is left for KV"
            raise ValueError(f"deployment {self.name}: the weights take {self.model.weight_bytes() / GB:.1f} GB and the "
                             f"workspace (a full batch's activations, a sequence's KV for one layer) "
                             f"{workspace / GB:.1f} GB of the {usable / GB:.1f} GB usable "
                             f"({self.gpu_memory_utilization:g} of {self.gpu.name}), so {left}, where one "
                             f"{self.max_model_len}-token sequence needs {need / GB:.1f} GB (as vLLM refuses it: a "
                             f"shorter context, CHECKPOINT_DIR@GPU:LEN for a checkpoint; quantised weights; a larger GPU)"
                             + self._window_caveat())
        return kv

    def _window_caveat(self) -> str:
        """What a refusal adds for a model with windowed layers, whose KV this sizing counts whole."""
        m = self.model
        if not m.window_layers:
            return ""
        kind = "chunk" if m.window_chunked else "window"
        return (f"; {len(m.window_layers)} of its {m.num_layers} layers attend through a {m.sliding_window}-token "
                f"{kind}, their KV counted whole here where vLLM v1 keeps only the {kind}'s: vLLM may serve this context")

    def num_blocks(self) -> int:
        return self.kv_bytes() // (self.model.kv_bytes_per_token() * self.block_size)

    def engine_config(self, **overrides) -> EngineConfig:
        base = EngineConfig(block_size=self.block_size, num_blocks=self.num_blocks(),
                            segment_blocks=max(64, self.num_blocks() // 64), max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
                            restart_downtime_s=self.restart_downtime_s, device_bytes=self.gpu.memory_bytes,
                            host_bytes=256 * GB)
        return replace(base, **overrides)

    def cost_model(self, **overrides) -> RooflineCostModel:
        return RooflineCostModel(self.gpu, self.model, **overrides)

    def describe(self) -> str:
        blocks = self.num_blocks()
        active = f" ({self.model.param_count(active=True) / 1e9:.1f}B active)" if self.model.num_experts else ""
        experts = "" if self.model.expert_weight_bits is None else f" (its experts at {self.model.expert_weight_bits:g})"
        return (f"{self.name}: {self.model.param_count() / 1e9:.1f}B params{active} at {self.model.weight_bits or 8 * self.model.dtype_bytes} "
                f"bits{experts} on {self.gpu.name}; KV {blocks} blocks x {self.block_size} = {blocks * self.block_size} tokens "
                f"({self.kv_bytes() / GB:.1f} GB{'' if self.model.kv_cache_dtype == 'auto' else ' in ' + self.model.kv_cache_dtype})"
                + "".join(f"; {note}" for note in self.notes))


LLAMA_70B = ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                        num_kv_heads=8, max_position=131072, rope_theta=500000.0, dtype="float16", weight_bits=4)
LLAMA_7B = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                       num_kv_heads=32, max_position=4096, dtype="float16")
LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, max_position=131072, rope_theta=500000.0, dtype="float16")

LLAMA3_70B_FP8 = ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                             num_kv_heads=8, max_position=131072, rope_theta=500000.0, dtype="float16", weight_bits=8)

DEPLOYMENTS = {
    d.name: d for d in (
        Deployment("llama70b-4bit-h100", H100_SXM_80GB, LLAMA_70B, max_num_batched_tokens=2048),
        Deployment("llama7b-fp16-a10", A10_24GB, LLAMA_7B, max_num_seqs=128, max_num_batched_tokens=4096,
                   max_model_len=4096, restart_downtime_s=30.0),
        Deployment("llama3-8b-h200", H200_SXM_141GB, LLAMA3_8B, max_num_batched_tokens=16384, max_model_len=32768),
        Deployment("llama3-8b-l40s", L40S_48GB, LLAMA3_8B, max_num_batched_tokens=4096, max_model_len=32768),
        Deployment("llama70b-fp8-h200", H200_SXM_141GB, LLAMA3_70B_FP8, max_num_batched_tokens=4096,
                   max_model_len=32768),
        # tenants of a shared GPU (env/node_scenario.py): each sized by its MPS limit, not by the whole GPU
        Deployment("llama7b-fp16-h100", H100_SXM_80GB, LLAMA_7B, max_num_batched_tokens=4096, max_model_len=4096,
                   restart_downtime_s=20.0),
        Deployment("llama3-8b-h100", H100_SXM_80GB, LLAMA3_8B, max_num_batched_tokens=4096, max_model_len=16384,
                   restart_downtime_s=20.0),
    )
}


GPUS = {"h100": H100_SXM_80GB, "h200": H200_SXM_141GB, "a10": A10_24GB, "l40s": L40S_48GB}
CHECKPOINT_MAX_MODEL_LEN = 32768  # the context a checkpoint deployment serves, where its model allows as much


def deployment(name: str) -> Deployment:
    """The deployment ``name``: one of ``DEPLOYMENTS``, or ``CHECKPOINT_DIR@GPU`` (or
    ``CHECKPOINT_DIR@GPU:LEN``, serving a context of LEN tokens, as vLLM's ``--max-model-len``; and
    ``:fp8``, or another of ``KV_CACHE_DTYPES``, holding the KV in it, as vLLM's ``--kv-cache-dtype``), a local
    checkpoint's model (only its ``config.json`` is read) on one of ``GPUS``; a bare directory
    name that is not here is looked for among the shipped ``experiments/checkpoints``."""
    if name in DEPLOYMENTS:
        return DEPLOYMENTS[name]
    if "@" in name:
        return _checkpoint_deployment(name)
    raise ValueError(f"unknown deployment {name!r}; known: {', '.join(DEPLOYMENTS)}, "
                     f"or CHECKPOINT_DIR@GPU[:LEN][:KV_DTYPE] with GPU one of {', '.join(GPUS)} "
                     f"(shipped checkpoints: {', '.join(_shipped_checkpoints())})")


def _shipped_checkpoints() -> list[str]:
    from experiments import CHECKPOINTS

    return sorted(p.parent.name for p in CHECKPOINTS.glob("*/config.json"))


@functools.lru_cache(maxsize=None)
def _checkpoint_deployment(name: str) -> Deployment:
    """As vLLM sizes a checkpoint it serves by default: the checkpoint's dtype (float16 for a
    float32 one; bfloat16 for Gemma 2's and 3's, which it refuses in float16: ``read_sizes``), its
    quantised weights' bits, 90 % of the GPU, blocks of 16, 256 sequences,
    8,192 batched tokens; the context is its own, at most ``CHECKPOINT_MAX_MODEL_LEN``, or the
    ``:LEN`` the name gives."""
    from engine.checkpoint import (declared_context, declared_kv_cache_dtype, expert_bits, read_sizes,  # the loader's
                                   weight_bits)
    from experiments import CHECKPOINTS

    directory, gpu = name.rsplit("@", 1)
    directory = os.path.expanduser(directory)
    gpu, *options = gpu.split(":")
    kv = [o for o in options if o in KV_CACHE_DTYPES]
    lengths = [o for o in options if o not in KV_CACHE_DTYPES]
    if len(kv) > 1 or len(lengths) > 1:
        raise ValueError(f"deployment {name!r}: after the GPU, at most one context (':LEN') and one KV cache dtype "
                         f"(':{'|:'.join(KV_CACHE_DTYPES)}'), got {':'.join(options)!r}")
    colon, context = bool(lengths), lengths[0] if lengths else ""
    if not Path(directory).exists() and len(Path(directory).parts) == 1 and (CHECKPOINTS / directory).is_dir():
        directory = str(CHECKPOINTS / directory)
    if gpu.lower() not in GPUS:
        raise ValueError(f"deployment {name!r}: GPU {gpu!r} is not one of {', '.join(GPUS)}")
    if colon and not (context.isascii() and context.isdigit() and int(context) >= 2):
        raise ValueError(f"deployment {name!r}: the context after ':' must be a whole number of tokens >= 2, got "
                         f"{context!r} (or a KV cache dtype, one of {', '.join(KV_CACHE_DTYPES)})")
    try:
        model, notes = read_sizes(directory)
        bits, experts = weight_bits(directory), expert_bits(directory)
        if experts is not None and not model.num_experts:
            raise ValueError(f"{directory}: quant_method 'mxfp4' quantises a mixture of experts' experts "
                             "(gpt-oss's); this checkpoint has none")
        declared, kv_declared = declared_context(directory), declared_kv_cache_dtype(directory)
    except ValueError as exc:  # the checkpoint's own refusal names its file and field
        shipped = "" if Path(directory).exists() else f" (shipped checkpoints: {', '.join(_shipped_checkpoints())})"
        raise ValueError(f"deployment {name!r}: {exc}{shipped}") from None
    if context and int(context) > model.max_position:
        source = ("max_position_embeddings" + (", extended by its RoPE scaling as vLLM extends it"
                                               if model.max_position > declared else "")
                  if model.max_position >= declared else "its YaRN scaling's original_max_position_embeddings x factor, "
                  "as vLLM derives it")
        raise ValueError(f"deployment {name!r}: a context of {context} tokens is past the model's own "
                         f"({model.max_position}: {source})")
    model = replace(model, weight_bits=bits, expert_weight_bits=experts)
    if bits is None and (Path(directory) / "quantize_config.json").is_file():
        notes = [*notes, "its quantize_config.json (AutoGPTQ's and AutoAWQ's own file) is not read: vLLM reads it only "
                         "given --quantization, and config.json declares no quantisation, so the weights are sized "
                         "unquantised (a quantization_config in config.json sizes them at its bits)"]
    if not kv and kv_declared and model.kv_lora_rank:
        notes = [*notes, f"the checkpoint declares its KV calibrated for {kv_declared}, which vLLM holds it in; this "
                         "engine holds a latent cache in the model's dtype only: about half vLLM's tokens"]
    elif not kv and kv_declared:  # as vLLM holds it unless told otherwise (':auto')
        kv = [kv_declared]
        notes = [*notes, f"its KV in {kv_declared}, as the checkpoint declares it calibrated (vLLM holds it so by "
                         "default; ':auto' holds it in the model's dtype)"]
    if kv:
        try:
            model = replace(model, kv_cache_dtype=kv[0])
        except ValueError as exc:
            raise ValueError(f"deployment {name!r}: {exc}") from None
    d = Deployment(name, GPUS[gpu.lower()], model, notes=tuple(notes),
                   max_model_len=int(context) if context else min(model.max_position, CHECKPOINT_MAX_MODEL_LEN))
    d.kv_bytes()  # a checkpoint too large for the GPU is refused now, by name
    return d
