"""`hybridflow prepare-data shapes OUT_DIR`: a visual task drawn offline with PIL, in verl's multimodal format.

Each row's `prompt` is one user message whose text starts with the `<image>` placeholder, its `images`
column holds the picture as `[{"bytes": PNG}]`, and `reward_model.ground_truth` the one-word answer, which
the `shapes` rule scorer checks (`hybridflow.rewards.shapes`). Questions (`--question`):
- `colour`: one filled square of red, green or blue (`--colours` picks which), half the picture's side or
  more: which colour? (the easiest to learn: the answer is in the patches' mean colour)
- `count`: 1 to 4 squares of one colour on a 4x4 grid: how many?
- `compare`: red and blue squares, never as many of each: which colour has more?

Pictures are `--image-size` pixels square (56 by default: 4x4 patches of Qwen2-VL's 14 pixels, 4 image tokens
on the tiny models), drawn from a seeded generator; no picture appears in both splits.
`--format sft` writes `{prompt, response, images}` rows and `--format dpo` `{prompt, chosen, rejected,
images}` (a wrong answer rejected), TRL's vision formats; `--format form` SFT rows that teach only the answer's
form: a blank picture answered with a random valid answer.
"""

from __future__ import annotations

import io
import random
from typing import Any

from hybridflow.utils.errors import InputError

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220)}
QUESTIONS = {
    "colour": "What colour is the shape? Reply with one word: {choices}.",
    "count": "How many shapes are in the picture? Reply with a number from 1 to 4.",
    "compare": "Are there more red or more blue shapes? Reply with one word: red or blue.",
}


def _choices(colours: list[str]) -> str:
    return ", ".join(colours[:-1]) + " or " + colours[-1] if len(colours) > 1 else colours[0]


# squares sit in the cells of a grid of this many cells a side, so they never overlap
GRID = {"colour": 1, "count": 4, "compare": 4}


Square = tuple[int, str, float, float, float]  # grid cell, colour, side / cell side, where in the cell (x, y)


def _picture(squares: list[Square], grid: int, size: int) -> bytes:
    """A white picture with a filled square per ``(grid cell, colour, fill, x, y)`` (fill: the side as a
    fraction of the cell; x, y in [0, 1]: where the square sits in the room the cell leaves it), as PNG."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw, cell = ImageDraw.Draw(image), size / grid
    for index, colour, fill, x, y in squares:
        row, col = divmod(index, grid)
        side = max(2.0, cell * fill)
        x0, y0 = col * cell + (cell - side) * x, row * cell + (cell - side) * y
        draw.rectangle([x0, y0, x0 + side - 1, y0 + side - 1], fill=COLOURS[colour])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _square(rng: random.Random, cell: int, colour: str, low: float, high: float) -> Square:
    return (cell, colour, round(rng.uniform(low, high), 2), round(rng.random(), 2), round(rng.random(), 2))


def _colour(rng: random.Random, colours: list[str]) -> tuple[list[Square], str]:
    colour = rng.choice(colours)
    return [_square(rng, 0, colour, 0.5, 1.0)], colour


def _count(rng: random.Random, colours: list[str]) -> tuple[list[Square], str]:
    count, colour = rng.randint(1, 4), rng.choice(colours)
    cells = rng.sample(range(GRID["count"] ** 2), count)
    return [_square(rng, c, colour, 0.6, 0.9) for c in cells], str(count)


def _compare(rng: random.Random, colours: list[str]) -> tuple[list[Square], str]:
    red, blue = rng.sample(range(1, 5), 2)
    cells = rng.sample(range(GRID["compare"] ** 2), red + blue)
    squares = [_square(rng, c, "red" if i < red else "blue", 0.6, 0.9) for i, c in enumerate(cells)]
    return squares, "red" if red > blue else "blue"


_DRAW = {"colour": _colour, "count": _count, "compare": _compare}


def shapes_row(
    question: str, squares: list[Square], answer: str, size: int, colours: list[str]
) -> dict[str, Any]:
    text = QUESTIONS[question].format(choices=_choices(colours))
    return {
        "data_source": "shapes",
        "prompt": [{"role": "user", "content": "<image>" + text}],
        "images": [{"bytes": _picture(squares, GRID[question], size)}],
        "ability": "vision",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"question": question, "colours": colours},
    }


def shapes_splits(
    train_size: int,
    test_size: int,
    seed: int,
    question: str = "colour",
    size: int = 56,
    colours: list[str] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``train_size`` and ``test_size`` rows with distinct pictures; each split labelled and indexed.
    ``colours``: those the ``colour`` and ``count`` questions draw from (default all three)."""
    colours = list(COLOURS) if colours is None else list(colours)
    unknown = [c for c in colours if c not in COLOURS]
    if unknown or not colours:
        raise InputError(f"--colours: {unknown or 'none given'}; choose from {', '.join(sorted(COLOURS))}")
    rng, seen = random.Random(seed), set()
    rows: list[dict[str, Any]] = []
    for _ in range((train_size + test_size) * 50):
        if len(rows) == train_size + test_size:
            break
        squares, answer = _DRAW[question](rng, colours)
        if tuple(squares) not in seen:
            seen.add(tuple(squares))
            rows.append(shapes_row(question, squares, answer, size, colours))
    if len(rows) < train_size + test_size:
        raise InputError(f"only {len(rows)} distinct {question} pictures were drawn; ask for fewer rows")
    for split, part in (("train", rows[:train_size]), ("test", rows[train_size:])):
        for i, row in enumerate(part):
            row["extra_info"] = {**row["extra_info"], "split": split, "index": i}
    return rows[:train_size], rows[train_size:]


def wrong_answer(row: dict[str, Any], rng: random.Random) -> str:
    """Another answer of the row's question (a DPO pair's rejected reply)."""
    question, truth = row["extra_info"]["question"], row["reward_model"]["ground_truth"]
    colours = row["extra_info"].get("colours", list(COLOURS))
    choices = {"colour": colours, "count": ["1", "2", "3", "4"], "compare": ["red", "blue"]}[question]
    return rng.choice([c for c in choices if c != truth])


def _blank(size: int) -> bytes:
    return _picture([], 1, size)


def offline_rows(rows: list[dict[str, Any]], form: str, seed: int, size: int = 56) -> list[dict[str, Any]]:
    """The rows as SFT ``{prompt, response, images}`` or DPO ``{prompt, chosen, rejected, images}`` rows;
    ``form``: SFT rows that teach only the answer's form, a blank picture answered with a random valid answer
    (what SFT before RL teaches in the README's example)."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        keep = {k: row[k] for k in ("prompt", "images", "data_source", "extra_info")}
        truth = row["reward_model"]["ground_truth"]
        if form == "form":
            other = wrong_answer(row, rng)
            out.append({**keep, "images": [{"bytes": _blank(size)}], "response": rng.choice([truth, other])})
        elif form == "sft":
            out.append({**keep, "response": truth})
        else:
            out.append({**keep, "chosen": truth, "rejected": wrong_answer(row, rng)})
    return out
