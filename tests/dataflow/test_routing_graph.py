"""DataFlow / Router: per-row routing, chains, joins, metrics and graph validation."""

import numpy as np
import pytest
import torch

from hybridflow import DataProto
from hybridflow.dataflow import DataFlow, Router

CATEGORIES = ["creative", "factual", "chat", "creative", "factual", "factual", "chat"]
ANSWERS = ["poem", "Paris", "hi", "story", "Berlin", "Rome", "hey"]
KNOWLEDGE_BASE = {"q1": "Paris", "q4": "Madrid", "q5": "Rome"}


def prompts():
    return DataProto.from_dict(
        tensors={"scores": torch.tensor([1.0, 0.5, 0.2, 0.3, 0.9, 0.7, 0.4])},
        non_tensors={"category": CATEGORIES, "answer": ANSWERS, "qid": [f"q{i}" for i in range(7)]},
        meta_info={"temperature": 1.0, "metrics": {"rollout/len": 12.0}},
    )


def creative_bonus(data):
    data.batch["scores"] = data.batch["scores"] + 0.5
    return data


def fact_check(data):
    correct = [
        KNOWLEDGE_BASE.get(q) == a
        for q, a in zip(data.non_tensor_batch["qid"], data.non_tensor_batch["answer"])
    ]
    data.batch["scores"] = data.batch["scores"] * torch.tensor(correct, dtype=torch.float32)
    data.meta_info["metrics"] = {"fact_check/accuracy": sum(correct) / len(correct)}
    return data


def scenario_c():
    flow = DataFlow()
    flow.add_node("classify", Router("category"))
    flow.add_node("creative_bonus", creative_bonus)
    flow.add_node("fact_check", fact_check)
    flow.add_edge("classify", "creative_bonus", route="creative")
    flow.add_edge("classify", "fact_check", route="factual")
    flow.add_edge("classify", DataFlow.OUTPUT, route="default")
    return flow


def test_three_routes_three_handlers_merged_in_original_order():
    batch = prompts()
    out = scenario_c().run(batch)
    # creative rows 0, 3: +0.5; factual rows 1, 4, 5: kept only if the knowledge base agrees (1 and 5);
    # chat rows 2, 6 pass through unchanged.
    torch.testing.assert_close(out.batch["scores"], torch.tensor([1.5, 0.5, 0.2, 0.8, 0.0, 0.7, 0.4]))
    assert list(out.non_tensor_batch["qid"]) == [f"q{i}" for i in range(7)]
    assert list(out.non_tensor_batch["category"]) == CATEGORIES
    assert out.meta_info == {
        "temperature": 1.0,
        "metrics": {
            "rollout/len": 12.0,
            "route/classify/creative/count": 2,
            "route/classify/factual/count": 3,
            "route/classify/chat/count": 2,
            "fact_check/accuracy": pytest.approx(2 / 3),
        },
    }
    # The caller's batch is untouched.
    torch.testing.assert_close(batch.batch["scores"], prompts().batch["scores"])
    assert batch.meta_info["metrics"] == {"rollout/len": 12.0}


def test_route_without_an_edge_is_an_error_naming_route_router_and_known_routes():
    flow = DataFlow()
    flow.add_node("classify", Router("category"))
    flow.add_node("creative_bonus", creative_bonus)
    flow.add_node("fact_check", fact_check)
    flow.add_edge("classify", "creative_bonus", route="creative")
    flow.add_edge("classify", "fact_check", route="factual")
    with pytest.raises(ValueError) as err:
        flow.run(prompts())
    assert str(err.value) == (
        "DataFlow router 'classify' labelled 2 row(s) 'chat', a route with no edge; known routes: "
        "['creative', 'factual']. Add add_edge('classify', <node>, route='chat') or a route='default' edge"
    )


def test_chains_run_in_order_and_joins_see_one_batch_in_original_order():
    seen = []

    def normalize(data):
        seen.append(list(data.non_tensor_batch["qid"]))
        data.batch["scores"] = data.batch["scores"] - data.batch["scores"].mean()
        return data

    flow = (
        DataFlow()
        .add_node("classify", Router("category"))
        .add_node("double", lambda d: d.union(DataProto.from_dict({"scores2": d.batch["scores"] * 2})))
        .add_node("plus_one", lambda d: d.union(DataProto.from_dict({"extra": d.batch["scores2"] + 1})))
        .add_node(
            "copy",
            lambda d: d.union(
                DataProto.from_dict({"scores2": d.batch["scores"], "extra": d.batch["scores"]})
            ),
        )
        .add_node("normalize", normalize)
    )
    flow.add_edge("classify", "double", route="creative")
    flow.add_edge("double", "plus_one")
    flow.add_edge("plus_one", "normalize")
    flow.add_edge("classify", "copy", route="default")
    flow.add_edge("copy", "normalize")
    out = flow.run(prompts())

    assert seen == [[f"q{i}" for i in range(7)]]  # one call, all rows, original order
    # creative rows 0 and 3: (x * 2) + 1, i.e. 3.0 and 1.6; the others copy x.
    torch.testing.assert_close(out.batch["extra"], torch.tensor([3.0, 0.5, 0.2, 1.6, 0.9, 0.7, 0.4]))
    mean = torch.tensor([1.0, 0.5, 0.2, 0.3, 0.9, 0.7, 0.4]).mean()
    torch.testing.assert_close(out.batch["scores"], torch.tensor([1.0, 0.5, 0.2, 0.3, 0.9, 0.7, 0.4]) - mean)


def test_row_and_vectorized_routers_and_nested_flows():
    data = DataProto.from_dict({"x": torch.tensor([3.0, -1.0, 0.0, 2.0, -5.0])})
    negate = DataFlow().add_node("negate", lambda d: DataProto.from_dict({"x": -d.batch["x"]}))

    by_row = DataFlow().add_node("sign", Router(lambda row: "neg" if row["x"] < 0 else "nonneg"))
    by_row.add_node("abs", negate).add_edge("sign", "abs", route="neg").add_edge(
        "sign", DataFlow.OUTPUT, route="nonneg"
    )
    out = by_row.run(data)
    assert out.batch["x"].tolist() == [3.0, 1.0, 0.0, 2.0, 5.0]
    assert out.meta_info["metrics"] == {"route/sign/nonneg/count": 3, "route/sign/neg/count": 2}

    vectorized = DataFlow().add_node("sign", Router(lambda d: d.batch["x"] < 0, vectorized=True))
    vectorized.add_node("abs", negate).add_edge("sign", "abs", route=True).add_edge(
        "sign", DataFlow.OUTPUT, route=False
    )
    assert vectorized.run(data).batch["x"].tolist() == [3.0, 1.0, 0.0, 2.0, 5.0]


def test_plain_node_must_keep_the_row_count():
    flow = DataFlow().add_node("classify", Router("category")).add_node("drop", lambda d: d[:1])
    flow.add_edge("classify", "drop", route="default")
    with pytest.raises(
        ValueError, match="node 'drop' must return a DataProto with the 7 rows it got, returned 1 rows"
    ):
        flow.run(prompts())
    broken = DataFlow().add_node("scores", lambda d: d.batch["scores"])
    with pytest.raises(ValueError, match="node 'scores' .* returned Tensor"):
        broken.run(prompts())


def test_paths_that_deliver_different_columns_cannot_join():
    flow = DataFlow().add_node("classify", Router("category"))
    flow.add_node("tag", lambda d: d.union(DataProto.from_dict(non_tensors={"tag": ["x"] * len(d)})))
    flow.add_edge("classify", "tag", route="creative").add_edge("classify", DataFlow.OUTPUT, route="default")
    with pytest.raises(ValueError, match="paths joining at '<output>' deliver different columns: .*'tag'"):
        flow.run(prompts())


def test_graph_validation_errors():
    flow = (
        DataFlow().add_node("a", Router("category")).add_node("b", creative_bonus).add_node("c", fact_check)
    )
    with pytest.raises(
        ValueError, match=r"unknown node 'z'; add it with add_node first \(nodes: \['a', 'b', 'c'\]\)"
    ):
        flow.add_edge("a", "z", route="x")
    with pytest.raises(ValueError, match="edges from router 'a' need route="):
        flow.add_edge("a", "b")
    with pytest.raises(ValueError, match="'b' is not a Router, so the edge takes no route"):
        flow.add_edge("b", "c", route="x")
    with pytest.raises(ValueError, match="already taken"):
        flow.add_node("b", fact_check)
    with pytest.raises(ValueError, match=r"found \['a', 'b', 'c'\]"):
        flow.run(prompts())
    flow.add_edge("a", "b", route="x").add_edge("b", "c")
    with pytest.raises(ValueError, match="router 'a' already sends route 'x' to 'b'"):
        flow.add_edge("a", "c", route="x")
    with pytest.raises(ValueError, match="'b' already leads to 'c'; a plain node has one successor"):
        flow.add_edge("b", DataFlow.OUTPUT)
    with pytest.raises(ValueError, match="would close the cycle c -> b -> c"):
        flow.add_edge("c", "b")
    with pytest.raises(ValueError, match="would close the cycle c -> c"):
        flow.add_edge("c", "c")
    with pytest.raises(ValueError, match=r"router\(s\) \['r'\] have no outgoing edges"):
        DataFlow().add_node("r", Router("category")).run(prompts())
    with pytest.raises(KeyError, match="no column 'topic' to route on"):
        DataFlow().add_node("r", Router("topic")).add_edge("r", DataFlow.OUTPUT, route="default").run(
            prompts()
        )


def test_group_by_in_a_plain_python_loop():
    # Without a DataFlow: group rows by category, process each group, merge back in the original order.
    data = prompts()
    parts = []
    for category, (rows, index) in data.group_by("category").items():
        scale = {"creative": 10.0, "factual": 100.0}.get(category, 1.0)
        rows.batch["scores"] = rows.batch["scores"] * scale
        parts.append((rows, index))
    out = DataProto.merge_groups(parts)
    torch.testing.assert_close(out.batch["scores"], torch.tensor([10.0, 50.0, 0.2, 3.0, 90.0, 70.0, 0.4]))
    assert list(out.non_tensor_batch["qid"]) == [f"q{i}" for i in range(7)]
    np.testing.assert_array_equal(data.group_by("category")["factual"][1], [1, 4, 5])
