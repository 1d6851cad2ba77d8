"""Doing less arithmetic for the same gradient: one forward per shared run of tokens, token-budget micro-batches.

**Prefix trees.** GRPO and RLOO sample every prompt ``n`` times, and the rollout lays the ``n`` rows out
consecutively (``DataProto.repeat(n, interleave=True)``); chat prompts of one dataset also tend to begin with
the same system prompt or few-shot example. Scored row by row, each row recomputes all of it, forward and
backward: with the demo's ~95-token prompts (68 tokens the same in all) and 16-token answers, 8 prompts x 4
samples cost 32 x 111 token positions where 68 + 8 x 27 + 32 x 16 hold all the information.
``pack_prefix_tree`` inserts each row's real tokens, with their position ids, into a prefix tree and lays
the tree's nodes out as one packed row, with a 4-D attention mask in which every node attends to itself and
its ancestors: exactly the tokens before it in its own row, at the same positions. So the outputs are those
of the rows run one by one up to float rounding, and a shared node's gradient is the sum over the rows that
share it, which is what the unshared computation sums over its copies. Sharing is found by content, not by
``uid``: exact exactly when the tokens are identical, whatever their origin (SFT rows, replayed rows and
``n = 1`` share what they happen to share). Only the outputs that predict a response token reach the output
layer (``logits_to_keep`` as indices).

**Token-budget micro-batches** (verl's ``use_dynamic_bsz``): rather than a fixed row count, micro-batches are
filled up to ``max_token_len`` real tokens, after sorting by length so that rows of similar length (little
padding) travel together; groups are never split unless one alone exceeds the budget. The engine still
weights each micro-batch's loss by its share of the global batch, so the update does not depend on how the
batch was cut. Under FSDP2 the ranks first agree on one count (the largest any shard needs), and every
shard is cut into exactly that many micro-batches, balanced by tokens (``MicroBatching``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridflow.protocol import DataProto


def prompt_groups(data: DataProto) -> list[tuple[int, int]]:
    """``[start, end)`` row ranges of consecutive rows whose prompt columns (``input_ids``,
    ``attention_mask``, ``position_ids`` over the first ``T - L`` columns) are identical."""
    n = len(data)
    if n == 0:
        return []
    width = data.tensors["input_ids"].shape[1] - data.tensors["responses"].shape[1]
    same = torch.ones(n - 1, dtype=torch.bool)
    for key in ("input_ids", "attention_mask", "position_ids"):
        prompt = data.tensors[key][:, :width]
        same &= (prompt[1:] == prompt[:-1]).all(dim=1)
    starts = [0] + [i + 1 for i in torch.nonzero(~same).flatten().tolist()]
    return list(zip(starts, starts[1:] + [n]))


@dataclass
class PackedBatch:
    """Rows packed as prefix trees, one tree per packed row; the model's outputs at columns ``keep`` are
    gathered back into per-response positions with ``rows`` and ``cols``.

    ``input_ids`` ``(G, W)``; ``position_ids`` ``(G, W)``, or ``(3, G, W)`` for 3-D rotary positions;
    ``allowed`` ``(G, W, W)`` bool: column ``i`` attends to column ``j`` (``j`` is ``i`` or one of its
    ancestors); ``depth`` ``(G, W)``: each column's index among its row's real tokens (0 at padding), which
    a sliding window counts in (``attention_mask``); ``keep`` ``(K,)`` the columns whose outputs predict a
    response token (in some packed row); ``rows`` ``(bs,)`` the packed row of each original row; ``cols``
    ``(bs, L)`` the index into ``keep`` of the output that predicts each response token (0 where the row has
    no token there); ``images``: the images of the packed rows in the order their tokens appear (each shared
    image once)."""

    input_ids: torch.Tensor
    allowed: torch.Tensor
    depth: torch.Tensor
    position_ids: torch.Tensor
    keep: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    #: ``(bs, T)``: where each of the batch's real tokens sits in the packed input, flattened (``g * W + w``);
    #: -1 at padding (``hybridflow.workers.expert_routing.TokenPlaces``)
    places: torch.Tensor
    images: list[Any] = field(default_factory=list)

    def visible(self, window: int | None = None) -> torch.Tensor:
        """``allowed``, and with a sliding ``window`` only the ancestors fewer than ``window`` tokens back
        (a token and the ``window - 1`` before it in its row, as transformers' sliding layers see them)."""
        if window is None:
            return self.allowed
        return self.allowed & (self.depth[:, :, None] - self.depth[:, None, :] < window)

    def attention_mask(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """The additive ``(G, 1, W, W)`` mask (0 or the dtype's minimum) of ``visible(window)``."""
        visible = self.visible(window)
        return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)[:, None]

    def gather(self, outputs: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """``outputs`` ``(G, K, ...)`` (the model's outputs at columns ``keep``) -> ``(M, ...)``: the output
        that predicts each response token at ``real`` ``(bs, L)`` (row-major; a shared output repeated for
        each row it predicts a token of)."""
        rows, cols = self.predictors(real)
        return outputs[rows.to(outputs.device), cols.to(outputs.device)]

    def predictors(self, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For each response token at ``real`` ``(bs, L)`` (row-major), the packed row and the index into
        ``keep`` of the output that predicts it: ``(M,)`` each."""
        return self.rows[:, None].expand_as(self.cols)[real], self.cols[real]


class _Tree:
    """A prefix tree of ``(token, position, key)`` nodes, numbered in insertion order (a parent precedes its
    children); ``key`` tells apart tokens that are equal as ids but not as inputs (an image's tokens).
    ``images`` maps the node of each image's first token to the image."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.positions: list[Any] = []
        self.parents: list[int] = []
        self.depths: list[int] = []  # a node's index in the row(s) it belongs to
        self.children: dict[tuple[int, int, Any, int], int] = {}  # (parent, token, position, key) -> node
        self.images: dict[int, Any] = {}

    def walk(
        self,
        tokens: list[int],
        positions: list[Any],
        keys: list[int],
        firsts: dict[int, Any],
        share: bool = True,
    ) -> list[int]:
        """Insert one row's real tokens (``firsts``: the index of each image's first token -> the image);
        returns the node of each. ``share`` false: the row gets nodes of its own (a chain beside the others)."""
        nodes, node = [], -1
        for i, (token, position, key) in enumerate(zip(tokens, positions, keys)):
            child = self.children.get((node, token, position, key)) if share else None
            if child is None:
                child = len(self.tokens)
                if share:
                    self.children[(node, token, position, key)] = child
                self.tokens.append(token)
                self.positions.append(position)
                self.parents.append(node)
                self.depths.append(i)
                if i in firsts:  # an image is shared whole or not at all: its first token decides
                    self.images[child] = firsts[i]
            nodes.append(child)
            node = child
        return nodes

    def ancestors(self, width: int) -> torch.Tensor:
        """``(width, width)`` bool: node ``i`` attends to ``j`` iff ``j`` is ``i`` or one of its ancestors;
        columns past the tree's nodes (padding) attend to themselves only."""
        allowed = torch.eye(width, dtype=torch.bool)
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                allowed[node] |= allowed[parent]
        return allowed


@dataclass
class TokenInputs:
    """What a row's tokens are besides their ids, for rows with images: ``positions`` ``(3, bs, T)`` 3-D
    rotary positions (None: the batch's ``position_ids``), ``keys`` ``(bs, T)`` (0 at text tokens, the
    image's number at image tokens), ``images`` each row's images in order."""

    positions: torch.Tensor | None
    keys: torch.Tensor
    images: list[Any]


def _row_images(extra: TokenInputs | None, r: int, keys: list[int]) -> dict[int, Any]:
    """Index (among the row's real tokens) of each image's first token -> the image: the row's image tokens
    in order, ``num_tokens`` per image."""
    if extra is None:
        return {}
    columns = [i for i, key in enumerate(keys) if key]
    firsts, offset = {}, 0
    for image in extra.images[r]:
        firsts[columns[offset]] = image
        offset += image.num_tokens
    return firsts


def pack_prefix_tree(
    data: DataProto,
    max_width: int = 1024,
    extra: TokenInputs | None = None,
    share: bool = True,
    always: bool = False,
) -> PackedBatch | None:
    """Pack rows into prefix trees: a run of tokens (with their positions) that several rows begin with is
    one set of columns, computed once, and each token attends to exactly the tokens before it in its row(s),
    so outputs and gradients are those of the rows run one by one. Rows fill a packed row in order until it
    holds ``max_width`` tokens (the dense 4-D mask costs ``W^2``), so a group of samples of one prompt
    (consecutive rows) stays together when it fits.

    ``data.batch``: ``input_ids``, ``attention_mask``, ``position_ids`` ``(bs, P + L)`` (left-padded prompt,
    right-padded response) and ``responses`` ``(bs, L)``. Tokens with attention mask 0 are left out: no token
    attends to them and no response token is predicted from them. ``extra`` (rows with images): tokens are
    shared only when their positions (3-D where given) and image keys agree too, so an image's tokens and
    its encoder pass are shared exactly when the image and everything before it are. ``None`` when no two
    rows begin with the same token (packing would then only trade padding for a wider mask), unless
    ``always``. ``share`` false: every row is a chain of its own, the rows' real tokens end to end without
    padding (verl's ``use_remove_padding``), each attending only to its own row, as many rows to a packed row
    as fit in the longest row's length (so attention's ``W^2`` never exceeds the padded rows')."""
    ids, mask, pos = (data.tensors[k] for k in ("input_ids", "attention_mask", "position_ids"))
    length = data.tensors["responses"].shape[1]
    width = ids.shape[1] - length
    trees: list[_Tree] = [_Tree()]
    predictors: list[tuple[int, list[int]]] = []  # per row: its tree, the node predicting each response token
    members: list[tuple[torch.Tensor, list[int]]] = []  # per row: its real tokens' columns and their nodes
    if not share:  # rows end to end, as many as fit the longest one: no packed row costs more than it did
        max_width = int(mask.sum(dim=1).max())
    for r in range(len(data)):
        real = mask[r].bool()
        tokens = ids[r][real].tolist()
        held = len(trees[-1].tokens)
        if held >= max_width or (not share and held and held + len(tokens) > max_width):
            trees.append(_Tree())
        if extra is not None and extra.positions is not None:
            positions = [tuple(p) for p in extra.positions[:, r][:, real].T.tolist()]
        else:
            positions = pos[r][real].tolist()
        keys = extra.keys[r][real].tolist() if extra is not None else [0] * len(tokens)
        nodes = trees[-1].walk(tokens, positions, keys, _row_images(extra, r, keys), share)
        members.append((real.nonzero().flatten(), nodes))
        prompt_len, response_len = int(real[:width].sum()), int(real[width:].sum())
        # response token t is predicted by the node of the token before it (the last prompt token for t = 0)
        before = ([-1] + nodes)[prompt_len : prompt_len + response_len]
        predictors.append((len(trees) - 1, before))
    if not always and sum(len(tree.tokens) for tree in trees) == int(mask.sum()):
        return None
    return _layout(trees, predictors, members, ids.shape, length, ids.dtype, pos.dtype)


def _places(
    members: list[tuple[torch.Tensor, list[int]]], trees: list[int], shape: torch.Size, width: int
) -> torch.Tensor:
    """``PackedBatch.places``: each row's real tokens (``members``: their columns and nodes) at their node's
    flat position in the packed input, the row's tree ``trees[r]`` being packed row ``trees[r]``."""
    places = torch.full(shape, -1, dtype=torch.long)
    for r, (columns, nodes) in enumerate(members):
        places[r, columns] = trees[r] * width + torch.tensor(nodes, dtype=torch.long)
    return places


def _layout(
    trees: list[_Tree],
    predictors: list[tuple[int, list[int]]],
    members: list[tuple[torch.Tensor, list[int]]],
    shape: torch.Size,
    length: int,
    id_dtype: torch.dtype,
    pos_dtype: torch.dtype,
) -> PackedBatch:
    """The trees as packed rows: their tokens, positions, ancestor masks and images, where each original
    row's response predictions are, and where its tokens are (``members``: each row's real columns and their
    nodes; ``shape``: the batch's ``(bs, T)``)."""
    rows = shape[0]
    packed_width = max(len(tree.tokens) for tree in trees)
    packed_ids = torch.zeros(len(trees), packed_width, dtype=id_dtype)
    three_d = isinstance(trees[0].positions[0], tuple)
    packed_pos = torch.zeros((3,) * three_d + (len(trees), packed_width), dtype=pos_dtype)
    allowed = torch.zeros(len(trees), packed_width, packed_width, dtype=torch.bool)
    depth = torch.zeros(len(trees), packed_width, dtype=torch.long)
    images = []
    for g, tree in enumerate(trees):
        packed_ids[g, : len(tree.tokens)] = torch.tensor(tree.tokens, dtype=id_dtype)
        positions = torch.tensor(tree.positions, dtype=pos_dtype)
        if three_d:
            packed_pos[:, g, : len(tree.tokens)] = positions.T
        else:
            packed_pos[g, : len(tree.tokens)] = positions
        allowed[g] = tree.ancestors(packed_width)
        depth[g, : len(tree.tokens)] = torch.tensor(tree.depths, dtype=torch.long)
        images += [tree.images[node] for node in sorted(tree.images)]
    keep = sorted({node for _, before in predictors for node in before if node >= 0}) or [0]
    index = {node: k for k, node in enumerate(keep)}
    cols = torch.zeros(rows, length, dtype=torch.long)
    for r, (_, before) in enumerate(predictors):
        cols[r, : len(before)] = torch.tensor([index.get(node, 0) for node in before], dtype=torch.long)
    return PackedBatch(
        packed_ids,
        allowed,
        depth,
        packed_pos,
        torch.tensor(keep, dtype=torch.long),
        torch.tensor([g for g, _ in predictors], dtype=torch.long),
        cols,
        _places(members, [g for g, _ in predictors], shape, packed_width),
        images,
    )


@dataclass
class FlatRows:
    """Rows' real tokens end to end in one row, without padding (verl's ``use_remove_padding``):
    ``input_ids`` and ``position_ids`` ``(1, N)``, each row's positions counting from 0, which is how
    transformers tells where a row begins (its mask code on eager and SDPA attention, ``cu_seqlens`` for
    flash attention); ``keep`` ``(M,)``: the column whose output predicts each response token, row-major."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    keep: torch.Tensor


def flatten_rows(data: DataProto) -> FlatRows | None:
    """``data``'s rows (left-padded prompt, right-padded response) as ``FlatRows``; None when some row's
    positions do not start at 0 and count up by one (transformers would then see rows begin elsewhere)."""
    mask = data.tensors["attention_mask"].bool()
    positions = data.tensors["position_ids"]
    if positions.dim() != 2:  # 3-D rotary positions (images): no row boundaries to read from them
        return None
    flat_pos, lengths = positions[mask], mask.sum(dim=1)
    if not torch.equal(flat_pos, _ranks(lengths).to(flat_pos.dtype)):
        return None
    starts = torch.cumsum(lengths, 0) - lengths
    width = mask.shape[1] - data.tensors["responses"].shape[1]
    prompt, response = mask[:, :width].sum(dim=1), mask[:, width:].sum(dim=1)
    first = starts + prompt - 1  # the column that predicts each row's first response token
    keep = torch.repeat_interleave(first, response) + _ranks(response)
    return FlatRows(data.tensors["input_ids"][mask][None], flat_pos[None], keep)


def _ranks(counts: torch.Tensor) -> torch.Tensor:
    """``0, 1, ..., c - 1`` for each count ``c``, end to end."""
    total = int(counts.sum())
    return torch.arange(total) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)


def _token_counts(data: DataProto, groups: list[tuple[int, int]], share_prompt: bool) -> list[int]:
    """Real tokens each group costs: one prompt per group when shared, one per row otherwise."""
    mask = data.tensors["attention_mask"]
    width = mask.shape[1] - data.tensors["responses"].shape[1]
    per_row = mask.sum(dim=1).tolist()
    prompt = mask[:, :width].sum(dim=1).tolist()
    return [
        sum(per_row[a:b]) - (b - a - 1) * prompt[a] if share_prompt else sum(per_row[a:b]) for a, b in groups
    ]


def _greedy_parts(costs: list[int], budget: int) -> list[int]:
    """Start index of each part when ``costs`` are taken in order and a part closes before it would pass
    ``budget`` (a cost over the budget alone still makes one part)."""
    starts, used = [], budget + 1
    for i, cost in enumerate(costs):
        if used + cost > budget:
            starts.append(i)
            used = 0
        used += cost
    return starts


def _balanced_parts(costs: list[int], parts: int) -> list[int]:
    """Start indices of exactly ``parts`` (<= ``len(costs)``) consecutive parts of ``costs`` whose largest
    sum is smallest: the least budget the greedy cut fits in ``parts`` parts (found by bisection), then the
    heaviest parts split until there are ``parts`` of them (which never raises the largest sum)."""
    low, high = max(costs), sum(costs)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if len(_greedy_parts(costs, mid)) <= parts else (mid + 1, high)
    starts = _greedy_parts(costs, low)
    while len(starts) < parts:
        bounds = starts + [len(costs)]
        a, b = max(
            ((s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e - s > 1),
            key=lambda r: sum(costs[r[0] : r[1]]),
        )
        cut = min(range(a + 1, b), key=lambda c: max(sum(costs[a:c]), sum(costs[c:b])))
        starts = sorted(starts + [cut])
    return starts


@dataclass
class MicroBatching:
    """How a batch is cut into micro-batches: ``size`` rows each, or (``max_token_len`` set) as many rows as
    fit in that many real tokens; ``share_prompt`` says the forward shares prompts (a group's cost is then
    one prompt plus its responses).

    Ranks of an FSDP2-sharded model must run the same number of forwards and backwards (each all-gathers
    weights with the other ranks), but a token budget gives each rank's shard its own count. So the worker
    takes the largest of the ranks' ``count(shard)`` (an all-reduce) and passes it to ``indices``/``split``/
    ``batched``, which cut every shard into exactly that many micro-batches, balanced by tokens."""

    size: int
    max_token_len: int | None = None
    share_prompt: bool = True

    def count(self, data: DataProto) -> int:
        """Micro-batches ``data`` needs on its own (what this rank contributes to the agreed count)."""
        return len(self.indices(data))

    def indices(self, data: DataProto, count: int = 0) -> list[np.ndarray]:
        """Row indices of each micro-batch: at least ``count`` of them, together a permutation of
        ``range(len(data))``. With a token budget the micro-batches are consecutive runs of the groups
        sorted by length (little padding) whose largest token count is smallest; groups are split into
        row-chunks only when one alone exceeds the budget or there are fewer groups than micro-batches.
        With fewer rows than ``count``, the last ones are empty: fillers (see ``split``)."""
        n = len(data)
        if not self.max_token_len:
            step = max(1, self.size)
            batches = [np.arange(i, min(i + step, n)) for i in range(0, n, step)]
            return batches + [np.arange(0)] * (count - len(batches))
        groups = prompt_groups(data) if self.share_prompt else [(i, i + 1) for i in range(n)]
        units: list[tuple[int, int]] = []
        for a, b in groups:  # a group over the budget goes in as many row-chunks as it needs
            cost = _token_counts(data, [(a, b)], self.share_prompt)[0]
            chunks = max(1, min(b - a, -(-cost // self.max_token_len)))
            bounds = np.linspace(a, b, chunks + 1).round().astype(int)
            units += [(int(s), int(e)) for s, e in zip(bounds[:-1], bounds[1:])]
        costs = _token_counts(data, units, self.share_prompt)
        wanted = max(count, len(_greedy_parts(sorted(costs, reverse=True), self.max_token_len)))
        while len(units) < wanted and any(b - a > 1 for a, b in units):  # fewer groups than micro-batches
            u = max((u for u in range(len(units)) if units[u][1] - units[u][0] > 1), key=lambda u: costs[u])
            (a, b), mid = units[u], (units[u][0] + units[u][1]) // 2
            units[u : u + 1] = [(a, mid), (mid, b)]
            costs[u : u + 1] = _token_counts(data, units[u : u + 2], self.share_prompt)
        return _unit_batches(units, costs, wanted)

    def split(self, data: DataProto, count: int = 0) -> list[tuple[DataProto, bool]]:
        """``(micro_batch, real)`` for each of ``indices(data, count)``. A filler (``real`` false, from an
        empty index list) is ``data``'s shortest row standing in: its forward and backward keep this rank
        in step with ranks that have more micro-batches, and its result must count for nothing (the engine
        scales its loss by 0, ``batched`` drops its output)."""
        return [
            (data[idx], True) if len(idx) else (_stand_in(data), False) for idx in self.indices(data, count)
        ]


def _unit_batches(units: list[tuple[int, int]], costs: list[int], wanted: int) -> list[np.ndarray]:
    """``wanted`` micro-batches of whole ``units`` (row ranges) balanced by ``costs``, units of similar cost
    together (little padding); with fewer units than ``wanted`` the last ones are empty (fillers)."""
    order = sorted(range(len(units)), key=lambda u: -costs[u])
    starts = _balanced_parts([costs[u] for u in order], min(wanted, len(units))) if units else []
    batches = [
        np.asarray(sorted(r for u in order[s:e] for r in range(*units[u])), dtype=np.int64)
        for s, e in zip(starts, starts[1:] + [len(order)])
    ]
    return batches + [np.arange(0)] * (wanted - len(batches))


@dataclass
class PairBatching(MicroBatching):
    """Micro-batches of whole pairs (rows ``2k`` and ``2k + 1``: a preference pair's chosen and rejected, which
    one loss term compares): ``size`` pairs each, or as many pairs as fit ``max_token_len`` real tokens; a
    pair is never split, and fillers stand in where ranks must agree on a larger count."""

    share_prompt: bool = False

    def indices(self, data: DataProto, count: int = 0) -> list[np.ndarray]:
        pairs = [(a, a + 2) for a in range(0, len(data), 2)]
        if not self.max_token_len:
            step = max(1, self.size)
            batches = [np.arange(a, min(a + 2 * step, len(data))) for a in range(0, len(data), 2 * step)]
            return batches + [np.arange(0)] * (count - len(batches))
        costs = _token_counts(data, pairs, share_prompt=False)
        wanted = max(count, len(_greedy_parts(sorted(costs, reverse=True), self.max_token_len)))
        return _unit_batches(pairs, costs, wanted)

    def split(self, data: DataProto, count: int = 0) -> list[tuple[DataProto, bool]]:
        """As ``MicroBatching.split``, with the cheapest whole pair as the filler (a loss over pairs needs one)."""
        lengths = data.tensors["attention_mask"].sum(dim=1)
        cheapest = int((lengths[0::2] + lengths[1::2]).argmin())
        filler = data[[2 * cheapest, 2 * cheapest + 1]]
        return [(data[idx], True) if len(idx) else (filler, False) for idx in self.indices(data, count)]


def _stand_in(data: DataProto) -> DataProto:
    """The row with the fewest real tokens: the cheapest forward that keeps a rank in step."""
    return data[[int(data.tensors["attention_mask"].sum(dim=1).argmin())]]


def as_micro_batching(micro: int | MicroBatching) -> MicroBatching:
    return micro if isinstance(micro, MicroBatching) else MicroBatching(micro)


@torch.no_grad()
def batched(
    fn: Callable[[DataProto], Any], data: DataProto, micro: int | MicroBatching, count: int = 0
) -> Any:
    """``fn(micro_batch)`` over at least ``count`` micro-batches (fillers included, see
    ``MicroBatching.split``) without gradients (log-prob and value passes), the results of the real ones
    concatenated back in the rows' original order. ``fn`` returns a tensor ``(rows, ...)`` or a tuple of
    tensors (or ``None``s)."""
    batches = as_micro_batching(micro).indices(data, count)
    outputs = [fn(data[idx] if len(idx) else _stand_in(data)) for idx in batches]
    outputs = [out for out, idx in zip(outputs, batches) if len(idx)]
    inverse = torch.from_numpy(np.argsort(np.concatenate(batches), kind="stable"))

    def merge(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
        if parts[0] is None:  # a function that returns None (no entropy) does so for every part
            return None
        return torch.cat([p for p in parts if p is not None])[inverse]

    if isinstance(outputs[0], tuple):
        return tuple(merge([o[i] for o in outputs]) for i in range(len(outputs[0])))
    return merge(outputs)
