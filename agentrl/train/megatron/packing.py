"""`PackedRows`: a micro-batch as one THD row, split over context-parallel ranks in megatron's zigzag
layout; and the context-parallel gather of log-probs."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from agentrl.train.batch import MicroBatch


def zigzag(lengths: list[int], cp: int, rank: int) -> torch.Tensor:
    """Global packed indices of CP rank `rank`'s tokens: of every sequence (its length a multiple
    of 2 x cp), its chunk `rank` then its chunk 2 x cp - 1 - rank of 2 x cp equal chunks."""
    out, start = [], 0
    for n in lengths:
        half = n // (2 * cp)
        out.append(torch.arange(start + rank * half, start + (rank + 1) * half))
        out.append(torch.arange(start + n - (rank + 1) * half, start + n - rank * half))
        start += n
    return torch.cat(out)


class PackedRows:
    """A micro-batch's rows packed into one THD row: real tokens only, positions restarting per
    sequence, `cu_seqlens` at the boundaries, plus a padding sequence up to `length` and to a
    multiple of `multiple` (the TP size: sequence parallelism splits the row).

    With context parallelism (`cp` > 1) the layout is the one megatron-core's packed-THD code
    expects (`dsa_layout.build_packed_allgather_cp_local_positions`, `rope_utils`'
    `_get_thd_freqs_on_this_cp_rank`): every sequence is padded at its end to a multiple of
    2 x cp (its padding belongs to it: causal attention never lets a real token see it),
    `cu_seqlens` are the padded global boundaries, and CP rank r keeps, of every sequence, chunk r
    and chunk 2 x cp - 1 - r of its 2 x cp equal chunks (the "zigzag" that balances causal work).
    `local` indexes this rank's tokens in the global packed row; `gather_order` puts the
    all-gathered per-rank values back in global order."""

    def __init__(
        self, mb: MicroBatch, *, multiple: int = 1, length: int = 0, cp: int = 1, cp_rank: int = 0
    ) -> None:
        lengths = mb.attention_mask.sum(-1).tolist()
        device = mb.input_ids.device
        self.real = [int(n) for n in lengths]
        self.cp = cp
        ids = [mb.input_ids[r, :n] for r, n in enumerate(self.real)]
        if cp > 1:
            padded = [n + (-n) % (2 * cp) for n in self.real]
            ids = [
                torch.cat([x, torch.zeros(p - n, dtype=x.dtype, device=device)])
                for x, n, p in zip(ids, self.real, padded, strict=True)
            ]
            lengths = padded
            multiple = 2 * cp * multiple  # each rank's share stays a multiple of the TP size
        pad = max(length - sum(lengths), 0)
        pad += (-(sum(lengths) + pad)) % multiple
        if pad:
            lengths = [*lengths, pad]
            ids.append(torch.zeros(pad, dtype=mb.input_ids.dtype, device=device))
        self.lengths = [int(n) for n in lengths]
        self.total = sum(self.lengths)
        real = [torch.arange(n) < r for n, r in zip(self.lengths, [*self.real, 0], strict=False)]
        self.real_mask = torch.cat(real).to(device)  # [T]: False on every padding token
        self.num_rows = mb.num_rows
        self.input_ids = torch.cat(ids)[None]
        self.position_ids = torch.cat([torch.arange(n, device=device) for n in self.lengths])[None]
        cu = torch.tensor([0, *self.lengths], dtype=torch.int32).cumsum(0).to(torch.int32)
        self.cu_seqlens = cu.to(device)
        self.width = mb.input_ids.shape[1]
        if cp > 1:
            every = [zigzag(self.lengths, cp, r) for r in range(cp)]
            self.local = every[cp_rank].to(device)
            self.gather_order = torch.argsort(torch.cat(every)).to(device)

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and position_ids [1, T] of this CP rank (all of them without CP)."""
        if self.cp == 1:
            return self.input_ids, self.position_ids
        return self.input_ids[:, self.local], self.position_ids[:, self.local]

    def packed_seq_params(self, *, mark_padding: bool = False) -> Any:
        """megatron's THD metadata. `mark_padding`: tell the DSA indexer loss which query rows are
        padding (`real_token_mask_q`, read by `dsa_masking.extract_query_valid_rows_from_packed_seq_params`)
        so that they add nothing to it, as if the sequences were unpadded."""
        from megatron.core.packed_seq_params import PackedSeqParams

        longest = max(self.lengths)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
        if mark_padding:
            params.real_token_mask_q = self.real_mask if self.cp == 1 else self.real_mask[self.local]
        # For `gqa.PackedCoreAttention`: the lengths on the host (no device sync in every layer)
        # and, under CP, the order of the all-gathered ranks' tokens in the packed row.
        params.agentrl_lengths = self.lengths
        params.agentrl_gather_order = self.gather_order if self.cp > 1 else None
        return params

    def targets(self) -> torch.Tensor:
        """Token t's target is token t + 1 of the same sequence (a sequence's last token has none:
        its target is a placeholder, dropped by `unpack`); this CP rank's targets under CP."""
        targets = torch.roll(self.input_ids[0], -1)
        return targets if self.cp == 1 else targets[self.local]

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """`unpack`'s inverse: [rows, width] values of the batch's tokens -> [T] per position of
        this CP rank, position t holding the value of the token it predicts (0 where it predicts
        none: a sequence's last token, padding)."""
        out = values.new_zeros(self.total)
        start = 0
        for r in range(self.num_rows):
            n = self.real[r]
            if n > 1:
                out[start : start + n - 1] = values[r, 1:n]
            start += self.lengths[r]
        return out if self.cp == 1 else out[self.local]

    def pack_tokens(self, values: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        """[rows, width, ...] values of the batch's tokens -> [T, ...] at each token's own packed
        position (not shifted), `fill` (broadcast to the trailing shape) on padding; this CP
        rank's positions under CP."""
        out = fill.to(values.dtype).expand(self.total, *values.shape[2:]).clone()
        start = 0
        for r in range(self.num_rows):
            n = self.real[r]
            out[start : start + n] = values[r, :n]
            start += self.lengths[r]
        return out if self.cp == 1 else out[self.local]

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position values [T] (for the next token) -> [rows, width] aligned with the batch:
        entry (r, t) is the value for token t of row r, predicted at position t - 1; column 0 is 0."""
        out = values.new_zeros(self.num_rows, self.width)
        start = 0
        for r in range(self.num_rows):
            n = self.real[r]
            if n > 1:
                out[r, 1:n] = values[start : start + n - 1]
            start += self.lengths[r]
        return out


class _GatherContextParallel(torch.autograd.Function):
    """All-gather per-token values [T_local] over the CP group -> [cp x T_local] (rank order).
    Every CP rank then computes the same loss from the same gathered values, so the gradient of
    rank r's own slice is already complete on rank r: the backward keeps that slice (no sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.rank, ctx.n = dist.get_rank(group), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n].contiguous(), None
