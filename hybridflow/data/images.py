"""Images in data rows: reading them, and turning chat messages with ``<image>`` markers into the ids a
vision-language model sees.

A prompt holds its images as ``<image>`` markers in the message text (verl's format; OpenAI content parts
become markers when a row is read), and its images travel beside it as ``ImageInput``s
(``hybridflow.models.vision``). ``ImagePrompts`` renders the messages with the chat template (each marker an
``{"type": "image"}`` part, which the template writes as the family's placeholder), expands each
placeholder to the image's token count, and tokenizes: the ids are what the model sees, so
``data.max_prompt_length`` counts image tokens as the model does.

Why not ``AutoProcessor``: for the Qwen families it also builds a video processor, which needs
torchvision, and torchvision does not load beside the local torch build. The image processor alone
(``AutoImageProcessor``) loads, on its PIL backend (transformers falls back to it without torchvision, with
a warning), and the placeholder expansion is the processor's own rule (``VisionFamily.tokens``).
"""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hybridflow.models.vision import ImageInput, vision_family
from hybridflow.utils.errors import InputError

IMAGE_MARKER = "<image>"
# what a saved processor consists of besides the tokenizer (which saves itself)
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)


def decode_image(value: Any, where: str, base_dir: str | Path | None = None) -> tuple[Any, bytes]:
    """An image from a data row: ``{"bytes": ...}`` (base64 text in JSON) / ``{"path": ...}`` (the Hugging Face
    datasets layout verl uses), raw bytes, a file path (relative paths from ``base_dir``, the data file's folder, else the
    working folder) or a PIL image. Returns ``(RGB PIL image, encoded bytes)``; an image that cannot be
    read or decoded is an ``InputError`` naming ``where`` and why."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.convert("RGB").save(buffer, format="PNG")
        return value.convert("RGB"), buffer.getvalue()
    if isinstance(value, dict):
        if isinstance(value.get("bytes"), str):  # JSON has no bytes: base64 text
            value = {"bytes": _base64(value["bytes"], where)}
        value = value.get("bytes") or value.get("path")
    if isinstance(value, str):
        path = Path(value).expanduser()
        if not path.is_absolute() and base_dir is not None and (Path(base_dir) / path).exists():
            path = Path(base_dir) / path
        if not path.is_file():
            raise InputError(f"{where}: image file not found: {value}")
        value = path.read_bytes()
    if not isinstance(value, bytes | bytearray):
        raise InputError(
            f"{where}: an image must be bytes, a file path, or {{'bytes': ...}} / {{'path': ...}}; got "
            f"{type(value).__name__}"
        )
    try:
        image = Image.open(io.BytesIO(value))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise InputError(f"{where}: the image cannot be decoded ({e})") from e
    return image.convert("RGB"), bytes(value)


def _base64(text: str, where: str) -> bytes:
    import base64
    import binascii

    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InputError(f"{where}: the image's bytes are not valid base64 ({e})") from e


def marker_count(messages: Sequence[dict[str, str]]) -> int:
    return sum(m["content"].count(IMAGE_MARKER) for m in messages)


def as_parts(messages: Sequence[dict[str, str]]) -> list[dict[str, Any]]:
    """Messages with ``<image>`` markers -> messages whose content is a list of ``text`` and ``image``
    parts (what vision chat templates render); a message without a marker keeps its string content."""
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message["content"]
        if IMAGE_MARKER not in content:
            out.append(dict(message))
            continue
        parts: list[dict[str, Any]] = []
        for i, piece in enumerate(content.split(IMAGE_MARKER)):
            if i:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({**message, "content": parts})
    return out


class ImagePrompts:
    """Turns chat messages with ``<image>`` markers and their images into the ids the model sees.

    ``tokenizer``: the model's (its chat template renders image parts); ``image_processor``: the model's
    (``AutoImageProcessor``); ``config``: the model config (its ``model_type`` picks the family)."""

    def __init__(self, tokenizer: Any, image_processor: Any, config: Any, source: str | None = None) -> None:
        family = vision_family(config)
        if family is None:
            raise InputError(f"model type {config.model_type!r} is not a registered vision-language family")
        self.tokenizer, self.image_processor, self.config, self.family = (
            tokenizer,
            image_processor,
            config,
            family,
        )
        self.image_token_id = int(config.image_token_id)
        self.source = source  # the model folder the processor's files came from

    def save_pretrained(self, folder: str | Path) -> None:
        """The processor's files as the model folder has them (``AutoProcessor`` reads them; the tokenizer is
        saved on its own), so a checkpoint is a complete vision-language model folder."""
        import shutil

        if self.source is None:
            self.image_processor.save_pretrained(folder)
            return
        for name in PROCESSOR_FILES:
            if (Path(self.source) / name).is_file():
                shutil.copyfile(Path(self.source) / name, Path(folder) / name)

    @classmethod
    def from_pretrained(
        cls, path: str, tokenizer: Any, trust_remote_code: bool = False
    ) -> ImagePrompts | None:
        """The folder's image processing, or None when the model is a text model."""
        from transformers import AutoConfig, AutoImageProcessor

        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        if vision_family(config) is None:
            return None
        try:
            processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        except OSError as e:
            raise InputError(
                f"{path}: a {config.model_type} model without its image processor (preprocessor_config.json); "
                "copy the processor's files from the base model's folder"
            ) from e
        return cls(tokenizer, processor, config, path)

    def image_input(self, image: Any, data: bytes) -> ImageInput:
        """One decoded RGB image (``decode_image``) as the model takes it."""
        out = self.image_processor(images=[image], return_tensors="np")
        arrays = {k: np.ascontiguousarray(out[k]) for k in self.family.keys}
        digest = hashlib.sha1()
        for key in self.family.keys:
            digest.update(arrays[key].tobytes())
        return ImageInput(arrays, self.family.tokens(arrays, self.config), data, digest.hexdigest())

    def render(
        self,
        messages: Sequence[dict[str, str]],
        images: Sequence[ImageInput],
        where: str,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text with each image's placeholder expanded to its token count."""
        if marker_count(messages) != len(images):
            raise InputError(
                f"{where}: the prompt has {marker_count(messages)} {IMAGE_MARKER} placeholder(s) but the row has "
                f"{len(images)} image(s); put one {IMAGE_MARKER} where each image goes"
            )
        text = self.tokenizer.apply_chat_template(
            as_parts(messages),
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
        return self.expand(text, images, where)

    def expand(self, text: str, images: Sequence[ImageInput], where: str) -> str:
        """Each of ``text``'s image tokens (one per image, as the template wrote them) repeated
        ``num_tokens`` times."""
        token = self.family.image_token
        pieces = re.split(re.escape(token), text)
        if len(pieces) - 1 != len(images):
            raise InputError(
                f"{where}: the chat template wrote {len(pieces) - 1} image placeholder(s) {token!r} for "
                f"{len(images)} image(s); does the tokenizer's chat template render image parts?"
            )
        out = pieces[0]
        for image, piece in zip(images, pieces[1:]):
            out += token * image.num_tokens + piece
        return out

    def encode(
        self,
        messages: Sequence[dict[str, str]],
        images: Sequence[ImageInput],
        where: str,
        chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        """The prompt's token ids with the generation prompt, image tokens expanded."""
        text = self.render(messages, images, where, chat_template_kwargs)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def data_url_bytes(url: str, where: str, allowed_local_media_path: str | Path | None = None) -> bytes:
    """The image an ``image_url`` names: a ``data:`` URL (base64), or a local file (a path or ``file://``
    URL) only inside ``allowed_local_media_path`` (vLLM's rule); never a network fetch."""
    from urllib.parse import unquote, urlparse

    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise InputError(f"{where}: a data: URL image must be base64 (data:image/png;base64,...)")
        return _base64(payload, where)
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https", "ftp", "s3", "gs"):
        raise InputError(
            f"{where}: image URLs are not fetched ({parsed.scheme}://...); send the image as a data: URL"
        )
    if allowed_local_media_path is None:
        raise InputError(
            f"{where}: local image paths are refused unless the server runs with --allowed-local-media-path; "
            "send the image as a data: URL"
        )
    path = Path(unquote(parsed.path) if parsed.scheme == "file" else url).expanduser().resolve()
    allowed = Path(allowed_local_media_path).expanduser().resolve()
    if not path.is_relative_to(allowed):
        raise InputError(f"{where}: {path} is outside --allowed-local-media-path {allowed}")
    if not path.is_file():
        raise InputError(f"{where}: image file not found: {path}")
    return path.read_bytes()


def content_text(
    content: list, where: str, images: list[Any], allowed_local_media_path: str | Path | None = None
) -> str:
    """OpenAI / TRL content parts -> text with an ``<image>`` marker per image part. For each marker,
    ``images`` gets the image the part carries (``image_url`` with a ``data:`` URL, or a local file inside
    ``allowed_local_media_path``; TRL's ``{"type": "image", "image": bytes or path}``) or None
    (``{"type": "image"}``: the row's next image)."""
    text = ""
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text += part["text"]
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise InputError(f"{where}[{i}]: an image_url part needs image_url.url, got {part!r:.200}")
            text += IMAGE_MARKER
            images.append(data_url_bytes(url, f"{where}[{i}]", allowed_local_media_path))
        elif kind == "image":
            text += IMAGE_MARKER
            images.append(part.get("image"))
        else:
            raise InputError(
                f"{where}[{i}]: a content part must be {{'type': 'text', 'text': ...}}, {{'type': 'image'}} or "
                f"{{'type': 'image_url', 'image_url': {{'url': 'data:...'}}}}; got {part!r:.200}"
            )
    return text


def row_images(inline: list[Any], column: Any, where: str, image_key: str) -> list[Any]:
    """A prompt's images in marker order: each marker's own image, or else the next of the row's
    ``image_key`` column; the counts must agree."""
    if column is None:
        column = []
    if not isinstance(column, list | tuple | np.ndarray):
        raise InputError(
            f"{where}: field {image_key!r} must be a list of images, got {type(column).__name__}"
        )
    column = list(column)
    wanted = sum(image is None for image in inline)
    if wanted != len(column):
        raise InputError(
            f"{where}: the prompt has {wanted} {IMAGE_MARKER} placeholder(s) for the {image_key!r} column but the row "
            f"has {len(column)} image(s) there; put one {IMAGE_MARKER} where each image goes"
        )
    taken = iter(column)
    return [next(taken) if image is None else image for image in inline]


def thumbnail(image: ImageInput, size: int = 96) -> str:
    """A small PNG of ``image`` (at most ``size`` pixels a side) as a ``data:`` URL: what the run report shows
    beside a validation sample's prompt."""
    import base64

    picture = image.pil()
    picture.thumbnail((size, size))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def data_url(image: ImageInput) -> str:
    """``image``'s encoded bytes as a ``data:`` URL (what an agent puts in an ``image_url`` part)."""
    import base64

    from PIL import Image

    kind = (Image.open(io.BytesIO(image.data)).format or "png").lower()
    return f"data:image/{kind};base64," + base64.b64encode(image.data).decode()
