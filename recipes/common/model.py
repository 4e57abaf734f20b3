"""A small GPT-style decoder-only language model in plain PyTorch.

The model is intentionally tiny so recipes and tests run on CPU. The transformer
blocks live in ``GPT.blocks`` (an ``nn.ModuleList``) so FSDP2 can ``fully_shard``
each block individually and then the root module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "GPTStage"]


@dataclass
class GPTConfig:
    """Model hyperparameters; defaults are a CPU-sized model.

    ``vocab_size`` defaults to ``CharTokenizer().vocab_size`` (96); a test keeps
    the two in sync.
    """

    vocab_size: int = 96
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.1
    fused_qkv: bool = True
    """One projection for q, k and v (the default, as the DDP and FSDP2 recipes save it), or
    three (`q`, `k`, `v`): tensor parallelism shards each by heads, which a fused one's rows,
    q then k then v, would not allow (recipes/train_nd.py)."""
    tied_head: bool = True
    """The output head is the token embedding's weight (the default), or its own `head`
    Linear: pipeline stages (recipes/train_nd.py --pp) hold the embedding on the first stage
    and the head on the last, so the two cannot share one weight."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention backed by ``scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.head_dim = config.n_embd // config.n_head
        # One fused projection for q, k, v keeps the parameter count and FLOPs minimal; three
        # apart let tensor parallelism give each rank whole heads of each.
        if config.fused_qkv:
            self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        else:
            self.q = nn.Linear(config.n_embd, config.n_embd)
            self.k = nn.Linear(config.n_embd, config.n_embd)
            self.v = nn.Linear(config.n_embd, config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).split(self.n_embd, dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        # (B, T, C) -> (B, nh, T, hs), the layout SDPA expects. The heads are counted from
        # the width: under tensor parallelism each rank holds n_head / tp of them.
        q = q.view(b, t, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, t, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
        # is_causal=True builds the mask internally, so no mask buffer ends up in
        # state_dict (checkpoints then hold parameters only).
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, -1)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network with a 4x expansion and GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer LM with learned positions and a tied output head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = None if config.tied_head else nn.Linear(config.n_embd, config.vocab_size, False)
        self.apply(self._init_weights)
        # GPT-2 style: shrink residual-path projections so the residual stream's
        # variance does not grow with depth.
        resid_std = 0.02 / math.sqrt(2 * config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=resid_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Number of parameters (the tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(logits, loss)``; ``loss`` is ``None`` when ``targets`` is ``None``.

        ``idx`` and ``targets`` are int64 tensors of shape ``(B, T)`` with
        ``T <= block_size``; ``logits`` has shape ``(B, T, vocab_size)``.
        """
        _, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        # Tied head via F.linear on the embedding weight instead of a separate
        # nn.Linear sharing the Parameter: state_dict then has a single key for
        # the weight, so checkpoint save/load and state comparisons see no aliases.
        logits = F.linear(x, self.wte.weight) if self.head is None else self.head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


class GPTStage(GPT):
    """One pipeline stage of a GPT with an untied head, under the whole model's names.

    `keep(stage, stages)` splits the blocks evenly over the stages; the first stage also
    holds the embeddings, the last `ln_f` and the head. The other stages' blocks become
    `nn.Identity()` and the embeddings or the head `None`, so `blocks.3.mlp.fc.weight` is
    `blocks.3.mlp.fc.weight` on whichever stage holds it (docs/porting.md#pipelines). The
    forward maps the stage's input (token ids on the first stage, the previous stage's
    activations after it) to its output (activations, or the logits on the last stage), as
    torch.distributed.pipelining's PipelineStage calls it. One stage of one is the whole model.
    """

    def keep(self, stage: int, stages: int) -> GPTStage:
        if stages > 1 and self.head is None:
            raise ValueError("pipeline stages need GPTConfig(tied_head=False)")
        n = len(self.blocks)
        lo, hi = stage * n // stages, (stage + 1) * n // stages
        for i in range(n):
            if not lo <= i < hi:
                self.blocks[i] = nn.Identity()
        if stage > 0:
            self.wte = self.wpe = None  # type: ignore[assignment]
        if stage < stages - 1:
            self.ln_f = self.head = None  # type: ignore[assignment]
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.wte is not None:
            pos = torch.arange(x.shape[1], dtype=torch.long, device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        if self.ln_f is None:
            return x
        x = self.ln_f(x)
        return F.linear(x, self.wte.weight) if self.head is None else self.head(x)
