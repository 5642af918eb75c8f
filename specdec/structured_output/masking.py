"""Grammar bitmasks applied to logits (the kernels ``stage.StructuredOutputStage`` calls)."""
from __future__ import annotations

import torch


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], fallback_uniform: bool,
                  argmax_only: list[bool] | None = None) -> None:
    """Set disallowed logits of ``rows`` to -inf in place (``bitmask`` row r masks logits row r).

    ``argmax_only[j]``: only row ``rows[j]``'s argmax will be read (a greedy row without
    logprobs): it is left alone when its argmax is allowed, which is then the masked argmax
    too (ties included: the first maximum is allowed, so it is the first allowed maximum).
    A row left with no finite logit (a draft that gives every allowed token zero probability,
    or min_tokens banning the only token the grammar allows) becomes uniform over the allowed
    tokens when ``fallback_uniform``: any q is lossless as long as it is the one used."""
    if argmax_only is not None and any(argmax_only):
        rows = _rows_whose_argmax_is_banned(logits, bitmask, rows, argmax_only)
    if not rows:
        return
    if logits.device.type == "cpu":
        _apply_cpu(logits, bitmask, rows)
    else:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    if not fallback_uniform:
        return
    index = torch.tensor(rows, device=logits.device)
    dead = logits.index_select(0, index).amax(dim=-1) == float("-inf")
    for r in index[dead.cpu()].tolist():
        allowed = unpack_row(bitmask[r], logits.shape[1]).to(logits.device)
        with torch.inference_mode():
            logits[r] = torch.where(allowed, 0.0, float("-inf"))


def _rows_whose_argmax_is_banned(logits, bitmask, rows, argmax_only) -> list[int]:
    lazy = [r for r, only in zip(rows, argmax_only) if only]
    index = torch.tensor(lazy, dtype=torch.int64)
    if lazy == list(range(lazy[0], lazy[0] + len(lazy))):  # no copy of the rows
        top = logits[lazy[0]:lazy[0] + len(lazy)].argmax(dim=-1).cpu()
    else:
        top = logits.index_select(0, index.to(logits.device)).argmax(dim=-1).cpu()
    allowed = (bitmask[index, top // 32] >> (top % 32).to(torch.int32)) & 1
    banned = [lazy[j] for j in (allowed == 0).nonzero().flatten().tolist()]
    return [r for r, only in zip(rows, argmax_only) if not only] + banned


def _apply_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """numpy's table-driven unpackbits, then one masked fill (faster than xgrammar's CPU kernel)."""
    import numpy as np

    vocab = logits.shape[1]
    words = bitmask.numpy()[rows]
    allowed = torch.from_numpy(np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab])
    banned = allowed.view(torch.bool).logical_not_()
    first = rows[0]
    with torch.inference_mode():  # the runner's logits are inference tensors
        if rows == list(range(first, first + len(rows))):
            logits[first:first + len(rows)].masked_fill_(banned, float("-inf"))
        else:
            index = torch.tensor(rows)
            logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(banned, float("-inf")))


def unpack_row(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """One bitmask row -> [vocab_size] bool (the reference the fast paths are tested against)."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 1).view(-1)[:vocab_size].bool()
