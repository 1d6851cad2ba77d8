"""A tiny per-sample dataflow graph: route rows by a label, process each route, merge back in order.

Why: "score creative prompts with a bonus, fact-check factual ones, pass the rest through" should be
a handful of lines in the driver, not index bookkeeping.  A ``DataFlow`` is a DAG of named nodes:

* a plain node is a function ``DataProto -> DataProto`` returning the same number of rows;
* a ``Router`` node labels each row and sends it down the edge whose ``route`` equals the label (or the
  ``route="default"`` edge when no edge matches);
* rows leave the graph at a node without successors, or by an edge to ``DataFlow.OUTPUT``.

Each node runs once per ``run``, on every row that reaches it, in the original row order; when several
paths join at a node (or at the output) their rows are merged back in the original order first, so a
node that works on the whole batch (a batched reward model, a normalisation) sees one batch.  ``run``
returns every row in the original order, with ``meta_info["metrics"]`` holding the input's metrics, the
route counts (``route/<router>/<label>/count``) and the metrics nodes put into their outputs'
``meta_info["metrics"]`` (give them distinct names: a later node's value replaces an earlier one's).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch

from hybridflow.protocol import DataProto

__all__ = ["DataFlow", "Router", "DEFAULT_ROUTE"]

DEFAULT_ROUTE = "default"
NodeFn = Callable[[DataProto], DataProto]


class Router:
    """A node that labels every row; the flow sends each row down the edge whose ``route`` is its label.

    ``route`` is one of:

    * a column name: the label is that non-tensor column (or 1-D tensor) of the row;
    * a function of one row, ``fn(row) -> label``, where ``row`` is a dict of that row's non-tensor values
      and tensors (e.g. ``row["category"]``, ``row["responses"]`` of shape ``(response_length,)``);
    * with ``vectorized=True``, a function of the whole batch, ``fn(data) -> labels`` (a sequence, array
      or tensor of ``len(data)`` labels): one call per batch, for labels computed with tensor ops.

    Labels must be hashable; numpy and 0-d torch scalars are turned into Python values.
    """

    def __init__(self, route: str | Callable[..., Any], vectorized: bool = False) -> None:
        if isinstance(route, str):
            if vectorized:
                raise ValueError("Router(vectorized=True) needs a function of the batch, not a column name")
            self._label_batch: Callable[[DataProto], Sequence[Any] | np.ndarray | torch.Tensor] = (
                lambda data: _column(data, route)
            )
        elif not callable(route):
            raise TypeError(f"Router needs a column name or a function, got {type(route).__name__}")
        elif vectorized:
            self._label_batch = route
        else:
            self._label_batch = lambda data: [route(row) for row in _row_views(data)]
        self.route = route

    def labels(self, data: DataProto) -> list[Hashable]:
        """One label per row of ``data``, as plain Python values."""
        raw = self._label_batch(data)
        if isinstance(raw, torch.Tensor | np.ndarray):
            return raw.tolist()
        return [x.item() if isinstance(x, torch.Tensor | np.generic) else x for x in raw]

    def __repr__(self) -> str:
        return f"Router({getattr(self.route, '__name__', self.route)!r})"


def _column(data: DataProto, key: str) -> Sequence[Any] | np.ndarray | torch.Tensor:
    if key in data.non_tensor_batch:
        return data.non_tensor_batch[key]
    if data.batch is not None and key in data.batch.keys():
        values: torch.Tensor = data.batch[key]
        return values
    raise KeyError(f"Router: no column {key!r} to route on; available: {data.keys()}")


def _row_views(data: DataProto) -> list[dict[str, Any]]:
    """Per-row dicts of tensors and non-tensor values (views into ``data``, not copies)."""
    columns: dict[str, Any] = dict(data.batch.items()) if data.batch is not None else {}
    columns.update(data.non_tensor_batch)
    return [{k: v[i] for k, v in columns.items()} for i in range(len(data))]


class DataFlow:
    """A DAG of named nodes through which a batch's rows are routed; see the module docstring.

    Example (tutorial scenario C)::

        flow = DataFlow()
        flow.add_node("classify", Router("category"))
        flow.add_node("creative_bonus", add_creativity_bonus)
        flow.add_node("fact_check", check_against_knowledge_base)
        flow.add_edge("classify", "creative_bonus", route="creative")
        flow.add_edge("classify", "fact_check", route="factual")
        flow.add_edge("classify", DataFlow.OUTPUT, route="default")
        batch = flow.run(batch)

    Each node gets its own DataProto object, so it may add, replace or pop keys freely; but rows that
    reached a node without passing a router still share tensors with the caller's batch, so update
    tensors out of place (``scores = scores + bonus``, not ``scores += bonus``).  ``meta_info`` changes
    made by nodes do not reach the output, except ``meta_info["metrics"]``, which is collected.  A
    DataFlow is itself callable as ``DataProto -> DataProto``, so a flow can be a node of another flow.
    """

    OUTPUT = "<output>"

    def __init__(self) -> None:
        self._nodes: dict[str, Router | NodeFn] = {}
        self._edges: dict[str, dict[Hashable, str]] = {}  # src -> {route (None for plain nodes): dst}

    def add_node(self, name: str, node: Router | NodeFn) -> DataFlow:
        """Add a ``Router`` or a function ``DataProto -> DataProto``; returns self for chaining."""
        if name == self.OUTPUT or name in self._nodes:
            raise ValueError(f"DataFlow: node name {name!r} is already taken (or reserved for the output)")
        if not isinstance(node, Router) and not callable(node):
            raise TypeError(
                f"DataFlow node {name!r} must be a Router or a function DataProto -> DataProto, "
                f"got {type(node).__name__}"
            )
        self._nodes[name] = node
        self._edges[name] = {}
        return self

    def add_edge(self, src: str, dst: str, route: Hashable | None = None) -> DataFlow:
        """Connect ``src`` to ``dst`` (a node or ``DataFlow.OUTPUT``); returns self for chaining.

        Edges leaving a ``Router`` need a ``route`` (the label they take, or ``"default"`` for every label
        without its own edge); a plain node has at most one successor and its edge has no route."""
        for name in (src, dst):
            if name not in self._nodes and name != self.OUTPUT:
                raise ValueError(
                    f"DataFlow edge {src!r} -> {dst!r}: unknown node {name!r}; "
                    f"add it with add_node first (nodes: {list(self._nodes)})"
                )
        if src == self.OUTPUT:
            raise ValueError(f"DataFlow edge {src!r} -> {dst!r}: nothing leaves the output")
        edges = self._edges[src]
        if isinstance(self._nodes[src], Router):
            if route is None:
                raise ValueError(f"DataFlow edge {src!r} -> {dst!r}: edges from router {src!r} need route=")
            if route in edges:
                raise ValueError(
                    f"DataFlow: router {src!r} already sends route {route!r} to {edges[route]!r}"
                )
        else:
            if route is not None:
                raise ValueError(
                    f"DataFlow edge {src!r} -> {dst!r}: {src!r} is not a Router, so the edge "
                    f"takes no route (got route={route!r})"
                )
            if edges:
                raise ValueError(
                    f"DataFlow: {src!r} already leads to {edges[None]!r}; a plain node has one "
                    "successor (use a Router to split rows)"
                )
        cycle = self._path(dst, src)
        if cycle:
            raise ValueError(
                f"DataFlow edge {src!r} -> {dst!r} would close the cycle {' -> '.join([src, *cycle])}"
            )
        edges[route] = dst
        return self

    def _path(self, start: str, goal: str) -> list[str]:
        """Nodes on a path ``start -> ... -> goal`` (inclusive), or ``[]`` when there is none."""
        if start == goal:
            return [start]
        for nxt in self._edges.get(start, {}).values():
            rest = self._path(nxt, goal)
            if rest:
                return [start, *rest]
        return []

    def entry(self) -> str:
        """The node every batch starts at: the one node no edge leads to."""
        targets = {dst for edges in self._edges.values() for dst in edges.values()}
        roots = [name for name in self._nodes if name not in targets]
        if len(roots) != 1:
            raise ValueError(
                f"DataFlow needs exactly one entry node (a node no edge leads to), found "
                f"{roots or 'none'}; nodes: {list(self._nodes)}"
            )
        return roots[0]

    def _topological_order(self) -> list[str]:
        order: list[str] = []
        seen: set[str] = set()

        def visit(name: str) -> None:
            if name in seen or name == self.OUTPUT:
                return
            seen.add(name)
            for nxt in self._edges[name].values():
                visit(nxt)
            order.append(name)

        for name in self._nodes:
            visit(name)
        return order[::-1]

    def run(self, data: DataProto) -> DataProto:
        """Route every row of ``data`` through the graph; returns all rows in the original order."""
        start = self.entry()
        unrouted = [
            name for name, node in self._nodes.items() if isinstance(node, Router) and not self._edges[name]
        ]
        if unrouted:
            raise ValueError(f"DataFlow: router(s) {unrouted} have no outgoing edges")
        if len(data) == 0:
            return data
        meta = dict(data.meta_info)
        metrics: dict[str, Any] = dict(meta.pop("metrics", None) or {})
        # Rows travel without metrics in meta_info, so that merging paths never duplicates them.
        rows = DataProto(
            batch=data.batch.clone(recurse=False) if data.batch is not None else None,
            non_tensor_batch=dict(data.non_tensor_batch),
            meta_info=meta,
        )
        inboxes: dict[str, list[tuple[str, DataProto, np.ndarray]]] = {
            start: [("input", rows, np.arange(len(data)))]
        }
        for name in self._topological_order():
            if name not in inboxes:
                continue
            rows, index = _join(name, inboxes.pop(name))
            for dst, part, part_index in self._step(name, rows, index, metrics):
                inboxes.setdefault(dst, []).append((name, part, part_index))
        out, _ = _join(self.OUTPUT, inboxes[self.OUTPUT])
        out.meta_info = {**data.meta_info, "metrics": metrics}
        return out

    __call__ = run

    def _step(
        self, name: str, rows: DataProto, index: np.ndarray, metrics: dict[str, Any]
    ) -> list[tuple[str, DataProto, np.ndarray]]:
        """Run node ``name`` on ``rows`` (original positions ``index``); returns ``(next node, rows, index)``."""
        node, edges = self._nodes[name], self._edges[name]
        if not isinstance(node, Router):
            out = node(rows)
            if not isinstance(out, DataProto) or len(out) != len(rows):
                got = f"{len(out)} rows" if isinstance(out, DataProto) else type(out).__name__
                raise ValueError(
                    f"DataFlow node {name!r} must return a DataProto with the {len(rows)} rows "
                    f"it got, returned {got}"
                )
            metrics.update(out.meta_info.pop("metrics", None) or {})
            return [(edges.get(None, self.OUTPUT), out, index)]
        labels = node.labels(rows)
        if len(labels) != len(rows):
            raise ValueError(f"DataFlow router {name!r} gave {len(labels)} labels for {len(rows)} rows")
        sent = []
        for label, (part, local) in rows.group_by(lambda _: labels).items():
            dst = edges.get(label, edges.get(DEFAULT_ROUTE))
            if dst is None:
                raise ValueError(
                    f"DataFlow router {name!r} labelled {len(part)} row(s) {label!r}, a route "
                    f"with no edge; known routes: {list(edges)}. Add "
                    f"add_edge({name!r}, <node>, route={label!r}) or a route='default' edge"
                )
            metrics[f"route/{name}/{label}/count"] = len(part)
            sent.append((dst, part, index[local]))
        return sent


def _join(name: str, arrivals: list[tuple[str, DataProto, np.ndarray]]) -> tuple[DataProto, np.ndarray]:
    """Merge the rows arriving at node ``name`` (from several paths) into original order.

    Returns the merged rows and their original positions (sorted).  Paths must deliver the same
    columns; the error names the nodes that delivered different ones."""
    if len(arrivals) == 1:
        return arrivals[0][1], arrivals[0][2]
    key_sets = {src: sorted(part.keys()) for src, part, _ in arrivals}
    if len({tuple(keys) for keys in key_sets.values()}) > 1:
        raise ValueError(
            f"DataFlow: the paths joining at {name!r} deliver different columns: {key_sets}; "
            "every path must produce the same keys"
        )
    index = np.concatenate([idx for _, _, idx in arrivals])
    # merge_groups wants positions 0..k-1: rank each original position among the arriving rows.
    rank = np.empty(len(index), dtype=np.int64)
    rank[np.argsort(index, kind="stable")] = np.arange(len(index))
    bounds = np.cumsum([0, *(len(idx) for _, _, idx in arrivals)])
    merged = DataProto.merge_groups(
        (part, rank[lo:hi]) for (_, part, _), lo, hi in zip(arrivals, bounds[:-1], bounds[1:])
    )
    return merged, np.sort(index)
