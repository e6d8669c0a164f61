"""A compact Llama/Qwen2-family transformer (RMSNorm, RoPE, GQA, SwiGLU) over a static KV cache.

The model is stateless apart from its weights: tokens, RoPE positions, cache slots, the boolean
attention mask and the KV buffers all come in as arguments, and `forward` returns logits only.
Layers are taken from `self.layer_source` (any iterable of `Block`s), so a streamer that moves
weights onto the GPU just before each layer runs can replace it without touching this file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from backends.load_progress import current

ARCHS = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelArgs:
    """Hyperparameters shared by both loaders (GGUF metadata, HF config.json)."""

    arch: str  # "llama" | "qwen2"
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int  # SwiGLU width
    head_dim: int = 0  # 0 -> dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Per-frequency divisors of the RoPE inverse frequencies ([head_dim // 2]); covers linear and
    # llama3-style scaling and GGUF's rope_freqs tensor alike. None = plain RoPE.
    rope_factors: tuple[float, ...] | None = None
    qkv_bias: bool = False
    tied_embeddings: bool = False
    max_seq_len: int = 4096

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.rope_factors is not None and len(self.rope_factors) != self.head_dim // 2:
            raise ValueError(f"rope_factors needs {self.head_dim // 2} entries, got {len(self.rope_factors)}")


class KVCache:
    """Per-layer K and V buffers `[rows, kv_heads, slots, head_dim]`; the runtime decides what lives where."""

    def __init__(self, args: ModelArgs, *, rows: int, slots: int, dtype: torch.dtype, device: torch.device):
        shape = (rows, args.n_kv_heads, slots, args.head_dim)
        # zeros, not empty: a padded query reads slot 0 and must see finite numbers even before any write.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]

    def bytes_per_slot(self) -> int:
        """K and V bytes of one slot of one row, all layers."""
        k = self.k[0]
        return 2 * len(self.k) * k.shape[1] * k.shape[3] * k.element_size()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 (as HF and llama.cpp do) so bf16/fp16 weights keep full-precision statistics.
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rope:
    """cos/sin tables from explicit positions, rotate-half (HF/NeoX) convention.

    Deliberately not a module buffer: `model.to(torch.bfloat16)` must not round the frequencies.
    """

    def __init__(self, args: ModelArgs):
        cpu = torch.device("cpu")  # explicit: models are built under torch.device("meta")
        i = torch.arange(args.head_dim // 2, dtype=torch.float64, device=cpu)  # [head_dim // 2]
        inv = 1.0 / args.rope_theta ** (i * 2 / args.head_dim)
        if args.rope_factors is not None:
            inv = inv / torch.tensor(args.rope_factors, dtype=torch.float64, device=cpu)
        self._inv_freq = {cpu: inv}  # [head_dim // 2] float64, per device

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._inv_freq.get(positions.device)
        if inv is None:
            inv = self._inv_freq[positions.device] = self._inv_freq[torch.device("cpu")].to(positions.device)
        # Angles in float32 like the reference runtimes (float64 only for float64 test models).
        work = torch.float64 if dtype == torch.float64 else torch.float32
        ang = positions.to(work)[..., None] * inv.to(work)  # [rows, q, half]
        ang = torch.cat((ang, ang), dim=-1)[:, None]  # [rows, 1, q, head_dim]
        return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [rows, heads, q, head_dim]."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Block(nn.Module):
    """One pre-norm decoder layer: GQA attention over the cache, then a SwiGLU MLP."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        q_out, kv_out = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.wq = nn.Linear(args.dim, q_out, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, kv_out, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, kv_out, bias=args.qkv_bias)
        self.wo = nn.Linear(q_out, args.dim, bias=False)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.w_gate = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w_up = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w_down = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        *,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """x: [rows, q, dim]; mask: [rows, 1, q, s]; rows/slots: [rows, q] write addresses."""
        r, q, _ = x.shape
        h = self.attn_norm(x)
        xq = self.wq(h).view(r, q, self.n_heads, self.head_dim).transpose(1, 2)  # [rows, heads, q, hd]
        xk = self.wk(h).view(r, q, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [rows, kv_heads, q, hd]
        xv = self.wv(h).view(r, q, self.n_kv_heads, self.head_dim)  # [rows, q, kv_heads, hd]
        xq, xk = apply_rope(xq, cos, sin), apply_rope(xk, cos, sin)
        # Write the new keys/values first, then attend over the cache: the mask alone says who sees what.
        k_cache[rows, :, slots] = xk.transpose(1, 2)  # indexed view: [rows, q, kv_heads, hd]
        v_cache[rows, :, slots] = xv
        s = mask.shape[-1]
        keys, values = k_cache[:r, :, :s], v_cache[:r, :, :s]  # [rows, kv_heads, s, hd]
        o = F.scaled_dot_product_attention(xq, keys, values, attn_mask=mask, enable_gqa=True)  # [rows, heads, q, hd]
        x = x + self.wo(o.transpose(1, 2).reshape(r, q, self.n_heads * self.head_dim))
        h = self.ffn_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.arch not in ARCHS:
            raise ValueError(f"unsupported architecture {args.arch!r}; supported: {', '.join(ARCHS)}")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tied_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.rope = Rope(args)
        # Where forward gets its blocks: any iterable yielding them in order (a weight streamer can wrap
        # self.layers). A tuple, not a ModuleList, so it stays out of the state dict.
        self.layer_source: Iterable[Block] = tuple(self.layers)

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
        kv: KVCache,
        select: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits for a padded query block.

        tokens / positions / slots: [rows, q] (int64); slot = where each token's K/V is written.
        mask: [rows, q, s] bool, True = may attend; attention covers cache slots 0..s-1.
        select: (row_idx, q_idx) picks the queries that need logits -> [n, vocab]; None -> [rows, q, vocab].
        """
        r, q = tokens.shape
        x = self.tok_embeddings(tokens)  # [rows, q, dim]
        cos, sin = self.rope(positions, x.dtype)  # [rows, 1, q, hd]
        attn_mask = mask[:, None]  # [rows, 1, q, s]
        rows = torch.arange(r, device=tokens.device)[:, None].expand(r, q)  # [rows, q]
        for i, layer in enumerate(self.layer_source):
            x = layer(x, cos=cos, sin=sin, mask=attn_mask, k_cache=kv.k[i], v_cache=kv.v[i], rows=rows, slots=slots)
        if select is not None:
            x = x[select]  # [n, dim]
        x = self.norm(x)
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        return F.linear(x, weight)  # [rows, q, vocab] or [n, vocab]


def build(args: ModelArgs, load: Callable[[str], torch.Tensor]) -> Transformer:
    """A model whose every state-dict tensor comes from `load(name)`, without allocating random weights first."""
    with torch.device("meta"):
        model = Transformer(args)
    names = list(model.state_dict())
    tracker, state = current(), {}
    for i, name in enumerate(names):  # the load's progress, one tensor at a time (a cancelled load stops here)
        tracker.report("load", i / len(names), f"tensor {i + 1} of {len(names)}")
        state[name] = load(name)
    tracker.report("load", 1.0)
    model.load_state_dict(state, strict=True, assign=True)
    return model.requires_grad_(False).eval()


def init_random(args: ModelArgs, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> Transformer:
    """A randomly initialised model for tests (norm weights perturbed so they matter too)."""
    g = torch.Generator().manual_seed(seed)
    model = Transformer(args).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 1.0 if "embeddings" in name else 1 / math.sqrt(p.shape[-1])
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * std + (1.0 if "norm" in name else 0.0))
    return model.requires_grad_(False).eval()
