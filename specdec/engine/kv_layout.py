"""KV cache groups: layers that share one block table, and the KV budget split between them.

A hybrid model (Gemma 3: five sliding-window layers to one global; gpt-oss: alternating) has
layers that read only the last w positions beside layers that read everything. One block table
for all of them would keep every sliding layer's KV for the whole sequence; instead the layers
are grouped by window (vLLM's hybrid allocator does the same), each group has its own block pool
and block table, and a sliding group gives back its blocks behind the window as the sequence
advances (``KVCacheManager``). Group 0, the *primary* group, has the widest window (None: full
attention); a draft model's or EAGLE head's cache shares its block ids, so its window is widened
to what the draft reads.

A draft model that reads the target's token positions (same tokenizer) puts each of its layers in
the group of that layer's window (``with_draft_layers``; the primary group where no group has it),
so a sliding draft layer keeps only its window too. The draft catches up on the tokens it has not
seen only when it next drafts (not during a prompt's prefill, nor while a request drafts nothing),
so a group holding draft layers frees behind what the draft has seen, and budgets one whole
sequence (``blocks_per_sequence_window``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

FULL = None  # the window of a group whose layers attend to every position


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # keys each query reads: the last ``window`` positions, None: all of them
    layers: tuple[int, ...]  # the target layers whose caches use this group's block table
    num_blocks: int = 0  # the group's block pool (set once the budget is known)
    bytes_per_block: int = 0  # one block of every cache reading this group's table (set with num_blocks)
    draft_layers: tuple[int, ...] = ()  # the draft model's layers reading this group's table (with_draft_layers)

    @property
    def name(self) -> str:
        """The group's label in metrics: ``full_attention`` or ``sliding_window_<w>``."""
        return "full_attention" if self.window is None else f"sliding_window_{self.window}"

    @property
    def blocks_per_sequence_window(self) -> int | None:
        """The window that sizes one sequence's blocks: a group holding draft layers may keep a
        whole sequence while the draft has not caught up (None), any other its window."""
        return None if self.draft_layers else self.window


@dataclass(frozen=True)
class KVLayout:
    block_size: int
    groups: tuple[KVGroup, ...]  # [0]: the primary group (the widest window; draft caches too)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_bytes(self) -> int:
        return sum(g.num_blocks * g.bytes_per_block for g in self.groups)

    def describe(self) -> str:
        return ", ".join(f"{g.num_blocks} blocks for {len(g.layers)} {_name(g)} layers"
                         + (f" and {len(g.draft_layers)} of the draft's" if g.draft_layers else "")
                         for g in self.groups)

    def layer_groups(self, num_layers: int) -> list[int]:
        """The group index of each target layer."""
        owner = [0] * num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                owner[layer] = g
        return owner

    def draft_view(self) -> KVLayout:
        """The layout as the draft model's runner reads it: each group's draft layers as its layers."""
        return KVLayout(self.block_size, tuple(replace(g, layers=g.draft_layers, draft_layers=()) for g in self.groups))


def _wider(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else max(a, b)


def kv_groups(layer_windows: list[int | None], draft_window: int | None | bool = False) -> tuple[KVGroup, ...]:
    """Groups of the target's layers by window. ``draft_window``: False when no draft cache shares
    the block ids, else the window the draft reads (None: everything)."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(layer)
    windows = sorted(by_window, key=lambda w: float("inf") if w is None else w, reverse=True)
    primary = windows[0] if windows else None
    if draft_window is not False:
        primary = _wider(primary, draft_window)
    if len(windows) == 1:
        return (KVGroup(primary, tuple(range(len(layer_windows)))),)
    groups = [KVGroup(primary, tuple(by_window[windows[0]]))]
    for window in windows[1:]:
        if window == primary:
            groups[0] = KVGroup(primary, tuple(sorted(groups[0].layers + tuple(by_window[window]))))
        else:
            groups.append(KVGroup(window, tuple(by_window[window])))
    return tuple(groups)


def with_draft_layers(groups: tuple[KVGroup, ...], draft_windows: list[int | None]) -> tuple[KVGroup, ...]:
    """``groups`` with draft layer i (window ``draft_windows[i]``) in the group of its window, or
    the primary group (whose window is at least every draft layer's: ``kv_groups``'s draft_window)."""
    by_window = {g.window: i for i, g in enumerate(groups)}
    owned: list[list[int]] = [[] for _ in groups]
    for layer, window in enumerate(draft_windows):
        owned[by_window.get(window, 0)].append(layer)
    return tuple(replace(g, draft_layers=tuple(d)) for g, d in zip(groups, owned))


def group_blocks_per_sequence(window: int | None, max_model_len: int, max_k: int, max_chunk: int,
                              block_size: int) -> int:
    """Blocks one sequence can hold at once in a group: all of a max_model_len sequence (its K
    speculative slots and the bonus token included) for full attention; for a window w, the w - 1
    keys before a step's first row, the step's rows (at most ``max_chunk`` tokens and drafts, then
    the next drafts' K + 1 slots) and one block the window straddles."""
    full = -(-(max_model_len + max_k + 1) // block_size)
    if window is None:
        return full
    rows = min(max_chunk, max_model_len) + max_k + 1
    return min(full, -(-(window - 1 + rows) // block_size) + 1)


def split_kv_budget(budget: int, groups: tuple[KVGroup, ...], bytes_per_block: list[int],
                    blocks_per_seq: list[int], max_num_seqs: int, block_size: int) -> tuple[KVGroup, ...]:
    """Each group's block count from ``budget`` bytes. A sliding group gets the share one table for
    all layers would give it (so short sequences fit as many as before), but never more than
    ``max_num_seqs`` sequences can hold at once; the primary group gets the rest. A ``ValueError``
    when one sequence of every group does not fit."""
    needed = sum(n * b for n, b in zip(blocks_per_seq, bytes_per_block))
    if budget < needed:
        raise ValueError(
            f"KV cache of {budget} bytes cannot hold one sequence: it needs {needed} bytes ("
            + ", ".join(f"{n} blocks of {block_size} tokens for the {_name(g)} layers"
                        for g, n in zip(groups, blocks_per_seq)) + ")")
    total_bytes = sum(bytes_per_block)
    counts = [0] * len(groups)
    rest = budget
    for g in range(1, len(groups)):
        share = budget * bytes_per_block[g] // total_bytes // bytes_per_block[g]
        counts[g] = max(blocks_per_seq[g], min(share, max_num_seqs * blocks_per_seq[g]))
        rest -= counts[g] * bytes_per_block[g]
    for g in range(1, len(groups)):  # a tight budget: the primary group's one sequence comes first
        short = blocks_per_seq[0] * bytes_per_block[0] - rest
        if short <= 0:
            break
        give_back = min(counts[g] - blocks_per_seq[g], -(-short // bytes_per_block[g]))
        counts[g] -= give_back
        rest += give_back * bytes_per_block[g]
    counts[0] = rest // bytes_per_block[0]
    return tuple(replace(g, num_blocks=n, bytes_per_block=b) for g, n, b in zip(groups, counts, bytes_per_block))


def _name(group: KVGroup) -> str:
    return "full-attention" if group.window is None else f"window-{group.window}"
