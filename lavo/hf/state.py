"""The decoding state of :class:`~lavo.hf.modeling.LavoLMForCausalLM` as a ``transformers`` cache.

The state wraps the native :class:`lavo.model.ModelCache`; it never stores keys and values itself. Padding is
removed, not fed to the model: LAVO's windows are counted from the first position (docs/DESIGN.md, "Decisions
the paper leaves open", 4), so a row left-padded by ``p`` tokens would see its windows shifted by ``p`` and
continue differently from the same prompt alone. The rows are therefore kept in groups that have consumed the
same number of real tokens, one native cache per group, and each call runs the model once per group and per
number of new real tokens. A batch
without padding is one group and one call; left-padded prompts of ``k`` different lengths take ``k`` calls per
step, and each row continues exactly as it would alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache as HubCache

from ..layers.base import leading_padding
from ..model import LanguageModel, ModelCache


@dataclass(frozen=True)
class RowGroup:
    """Batch rows that have consumed the same real tokens: ``rows`` (LongTensor ``[G]``, on the CPU) are the
    batch rows of the cache's rows, in order; ``cache`` is None before the group's first real token."""

    rows: torch.Tensor
    cache: ModelCache | None


def real_spans(real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``real [B, T]`` bool -> the first real column (``T`` for a row of padding only) and the number of real
    columns of each row (CPU tensors); each row's real columns must be consecutive (left and/or right padding)."""
    real = real.cpu()
    count = real.sum(1)
    first = leading_padding(real)
    columns = torch.arange(real.shape[1])
    span = (columns >= first[:, None]) & (columns < (first + count)[:, None])
    broken = (span != real).any(1).nonzero().flatten().tolist()
    if broken:
        raise ValueError(f"rows {broken} have padding between real tokens: the attention mask of each row must be "
                         "ones in one block (left padding, or for scoring right padding too)")
    return first, count


def repeated_rows_advice(rows: int, batch: int) -> str:
    """What to do when ``generate()`` has repeated each of a state's ``rows`` prompts into a ``batch`` of rows (for
    ``num_beams`` or ``num_return_sequences``): it repeats the ids and the mask, not a state passed to it."""
    if batch % rows:
        return ""
    times = batch // rows
    return (f": generate() repeats each prompt {times} times (num_beams, num_return_sequences) but not a state "
            f"passed to it; call state.batch_repeat_interleave({times}) first")


class LavoState(HubCache):
    """A batch's decoding state for ``generate()``: row groups, each with its native cache.

    Its size is that of the native caches, constant in the context length for LAVO. ``reorder_cache`` (beam
    search), ``batch_select_indices`` and ``batch_repeat_interleave`` select rows of every group; ``crop`` cannot
    undo tokens already folded into LAVO's memory and raises.
    """

    def __init__(self, batch_size: int):
        super().__init__(layers=[])
        self.groups = [RowGroup(torch.arange(batch_size), None)]
        self.columns = 0  # input positions consumed, padding included: what `generate` counts

    @property
    def batch_size(self) -> int:
        return sum(len(group.rows) for group in self.groups)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns

    @property
    def is_linear(self) -> list[bool]:
        # not a linear-attention cache to transformers: generate() then cuts the positions already consumed off
        # input_ids passed in full with the state (transformers never cuts them for a linear one)
        return [False]

    def nbytes(self) -> int:
        """Bytes held by the native caches."""
        return sum(group.cache.nbytes() for group in self.groups if group.cache is not None)

    def feed(self, model: LanguageModel, ids: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        r"""Continue every row with its real tokens of ``ids [B, T]`` (``real [B, T]`` bool, None for all real);
        return ``logits [B, T, vocab]``, zero at padding."""
        B, T = ids.shape
        if B != self.batch_size:
            raise ValueError(f"the state holds {self.batch_size} rows, got input of batch size {B}"
                             f"{repeated_rows_advice(self.batch_size, B)}")
        first, count = real_spans(real) if real is not None else (torch.zeros(B, dtype=torch.long),
                                                                  torch.full((B,), T))
        pieces, groups = [], []
        for group in self.groups:
            for n in count[group.rows].unique().tolist():
                members = (count[group.rows] == n).nonzero().flatten()
                rows = group.rows[members]
                cache = group.cache
                if cache is not None and len(members) < len(group.rows):
                    cache = cache.select(members)
                if n > 0:
                    columns = first[rows, None] + torch.arange(n)
                    device_rows, columns = rows.to(ids.device)[:, None], columns.to(ids.device)
                    logits, cache = model(ids[device_rows, columns], cache=cache)
                    pieces.append((device_rows, columns, logits))
                groups.append(RowGroup(rows, cache))
        self.groups = groups
        self.columns += T
        if len(pieces) == 1 and pieces[0][2].shape[:2] == (B, T):
            return pieces[0][2]  # no padding: the rows are in order already
        # the tied embedding's rows, not model.config.vocab_size, which resize_token_embeddings leaves as it was;
        # the logits' dtype (autocast's), as an unpadded batch returns them
        dtype = pieces[0][2].dtype if pieces else model.embed.weight.dtype
        out = torch.zeros(B, T, model.embed.num_embeddings, dtype=dtype, device=ids.device)
        for device_rows, columns, logits in pieces:
            out[device_rows, columns] = logits.to(out.dtype)
        return out

    def select(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (LongTensor ``[B']``, repeats allowed), in that order."""
        index = index.cpu()
        group_of = torch.empty(self.batch_size, dtype=torch.long)
        local_of = torch.empty(self.batch_size, dtype=torch.long)
        for g, group in enumerate(self.groups):
            group_of[group.rows] = g
            local_of[group.rows] = torch.arange(len(group.rows))
        groups = []
        for g, group in enumerate(self.groups):
            taken = (group_of[index] == g).nonzero().flatten()
            if len(taken):
                cache = None if group.cache is None else group.cache.select(local_of[index[taken]])
                groups.append(RowGroup(taken, cache))
        self.groups = groups

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select(torch.arange(self.batch_size).repeat_interleave(repeats))

    def reset(self) -> None:
        self.__init__(self.batch_size)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a LAVO state cannot drop tokens: they are already summed into its memory")

    @property
    def is_croppable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return (f"LavoState(rows={self.batch_size}, groups={len(self.groups)}, columns={self.columns}, "
                f"nbytes={self.nbytes()})")
