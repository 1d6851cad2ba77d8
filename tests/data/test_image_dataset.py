"""Rows with images in verl's format: an `images` column of bytes or paths (parquet and JSONL), `<image>`
placeholders or OpenAI content parts; each image decoded when the dataset is built, its tokens counted as the
model sees them; bad rows named by file, row and reason."""

import base64
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from transformers import AutoTokenizer

from hybridflow.data import RLHFDataset, collate_fn
from hybridflow.data.images import ImagePrompts, data_url_bytes
from hybridflow.data.prepare import main as prepare_data
from hybridflow.data.visual_task import shapes_splits
from hybridflow.models import make_tiny_tokenizer
from hybridflow.rewards.shapes import compute_score
from hybridflow.utils.errors import InputError


def png(colour=(200, 10, 10), size=(56, 56)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def vision_row(content, images, answer="red"):
    return {
        "data_source": "shapes",
        "prompt": [{"role": "user", "content": content}],
        "images": images,
        "reward_model": {"ground_truth": answer},
    }


@pytest.fixture(scope="module")
def qwen(tiny_vlm):
    folder = tiny_vlm("qwen2_vl")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return tokenizer, ImagePrompts.from_pretrained(folder, tokenizer)


def test_bytes_paths_parquet_jsonl_and_content_parts_give_the_same_prompt(tmp_path, qwen):
    tokenizer, processor = qwen
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "red.png").write_bytes(png())
    url = "data:image/png;base64," + base64.b64encode(png()).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Which colour?"}]
    rows = [
        vision_row("<image>Which colour?", [{"bytes": png()}]),
        vision_row("<image>Which colour?", ["pics/red.png"]),  # relative to the data file's folder
        vision_row(parts, None),
        vision_row(
            [{"type": "image"}, {"type": "text", "text": "Which colour?"}], [{"path": "pics/red.png"}]
        ),
    ]
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "a.parquet")
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[1:]))
    ds = RLHFDataset([tmp_path / "a.parquet", tmp_path / "b.jsonl"], tokenizer, 64, processor=processor)
    items = [ds[i] for i in range(4)]
    assert all(item["raw_prompt"] == [{"role": "user", "content": "<image>Which colour?"}] for item in items)
    for item in items:
        assert item["input_ids"].tolist() == items[0]["input_ids"].tolist()
        assert [im.key for im in item["image_inputs"]] == [items[0]["image_inputs"][0].key]
    # a 56x56 picture: 4x4 patches of 14 pixels, merged 2x2: 4 image tokens, counted in the prompt
    image_tokens = int((items[0]["input_ids"] == processor.image_token_id).sum())
    assert image_tokens == items[0]["image_inputs"][0].num_tokens == 4
    batch = collate_fn(items)
    assert list(batch.non_tensor_batch["image_inputs"][2]) == list(items[2]["image_inputs"])


def test_image_tokens_count_against_max_prompt_length(tmp_path, qwen):
    tokenizer, processor = qwen
    small, large = png(size=(28, 28)), png(size=(112, 112))  # 1 and 16 image tokens
    pq.write_table(
        pa.Table.from_pylist([vision_row("<image>Colour?", [{"bytes": b}]) for b in (small, large)]),
        tmp_path / "d.parquet",
    )
    lengths = [
        len(ids)
        for ids in RLHFDataset(tmp_path / "d.parquet", tokenizer, 256, processor=processor).prompt_ids
    ]
    assert lengths[1] - lengths[0] == 15
    kept = RLHFDataset(tmp_path / "d.parquet", tokenizer, lengths[0] + 1, processor=processor)
    assert len(kept) == 1 and kept.num_filtered == 1
    with pytest.raises(InputError, match=r"d.parquet: row 1: .*cut into an image"):
        RLHFDataset(
            tmp_path / "d.parquet", tokenizer, lengths[0] + 1, "prompt", "left", False, processor=processor
        )


@pytest.mark.parametrize(
    ("content", "images", "message"),
    [
        (
            "<image>Colour?",
            [{"bytes": base64.b64encode(b"junk").decode()}],
            r"row 1: image 0: the image cannot be",
        ),
        (
            "<image>Colour?",
            [{"bytes": "not base64!"}],
            r"row 1: image 0: the image's bytes are not valid base64",
        ),
        ("<image><image>Colour?", ["ok.png"], r"row 1: .*2 <image> placeholder.* 1 image"),
        ("Colour?", ["ok.png"], r"row 1: .*0 <image> placeholder.* 1 image"),
        ("<image>Colour?", ["missing.png"], r"row 1: image 0: image file not found: missing.png"),
        ("<image>Colour?", "ok.png", r"row 1: field 'images' must be a list"),
    ],
)
def test_a_bad_image_row_names_file_row_and_reason(tmp_path, qwen, content, images, message):
    tokenizer, processor = qwen
    (tmp_path / "ok.png").write_bytes(png())
    rows = [vision_row("<image>Fine?", ["ok.png"]), vision_row(content, images)]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InputError, match="bad.jsonl: " + message):
        RLHFDataset(tmp_path / "bad.jsonl", tokenizer, 64, processor=processor)


def test_a_text_model_refuses_rows_with_images(tmp_path):
    (tmp_path / "t.jsonl").write_text(json.dumps(vision_row("<image>Colour?", [{"bytes": "x"}])) + "\n")
    with pytest.raises(
        InputError, match=r"t.jsonl: row 0: the row has 1 image\(s\) but the model is a text model"
    ):
        RLHFDataset(tmp_path / "t.jsonl", make_tiny_tokenizer(), 64)


def test_image_urls_are_data_urls_or_allowed_local_files_never_fetched(tmp_path):
    (tmp_path / "ok.png").write_bytes(png())
    assert data_url_bytes("data:image/png;base64," + base64.b64encode(b"abc").decode(), "t") == b"abc"
    with pytest.raises(InputError, match="not fetched"):
        data_url_bytes("https://example.com/cat.png", "t")
    with pytest.raises(InputError, match="--allowed-local-media-path"):
        data_url_bytes(str(tmp_path / "ok.png"), "t")
    assert data_url_bytes(f"file://{tmp_path}/ok.png", "t", tmp_path) == png()
    with pytest.raises(InputError, match="outside --allowed-local-media-path"):
        data_url_bytes(f"{tmp_path}/../ok.png", "t", tmp_path / "sub")


def test_the_shapes_task_is_seeded_distinct_and_scored_by_its_rule(tmp_path):
    train, test = shapes_splits(40, 10, seed=3, question="compare")
    again, _ = shapes_splits(40, 10, seed=3, question="compare")
    assert [r["images"][0]["bytes"] for r in train] == [r["images"][0]["bytes"] for r in again]
    pictures = [r["images"][0]["bytes"] for r in train + test]
    assert len(set(pictures)) == 50
    # the answer is what the picture shows: more red than blue pixels when the truth is red
    for row in train[:10]:
        pixels = np.asarray(Image.open(io.BytesIO(row["images"][0]["bytes"])))
        red = ((pixels[..., 0] > 150) & (pixels[..., 2] < 100)).sum()
        blue = ((pixels[..., 2] > 150) & (pixels[..., 0] < 100)).sum()
        assert (
            row["reward_model"]["ground_truth"] == ("red" if red > blue else "blue") or abs(red - blue) < 60
        )
    assert compute_score("red", "red") == {"score": 1.0, "acc": 1.0}
    assert compute_score(" Red. It is", "red") == {"score": 0.5, "acc": 1.0}
    assert compute_score("blue", "red") == {"score": 0.0, "acc": 0.0}
    prepare_data(["shapes", str(tmp_path), "--train-size", "6", "--test-size", "2", "--format", "dpo"])
    row = pq.read_table(tmp_path / "train.parquet").to_pylist()[0]
    assert {"prompt", "chosen", "rejected", "images"} <= set(row) and row["chosen"] != row["rejected"]
