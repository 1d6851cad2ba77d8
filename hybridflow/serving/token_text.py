"""A sample's tokens as OpenAI's wire format shows them: each token's raw bytes, and the text grown token by token.

Why raw bytes: a token of a byte-level tokenizer may hold part of a multi-byte character (``'З'`` is two tokens
of the tiny model's tokenizer), and decoding it alone gives U+FFFD. OpenAI's ``bytes`` field exists so that
joining the tokens' bytes gives the completion back byte for byte, which only the token's own bytes do:
read from the vocabulary (the byte-level alphabet of GPT-2-style tokenizers, the ``<0xNN>`` tokens of
byte-fallback ones). Where a token's bytes are not valid UTF-8 on their own, its ``token`` string is
``bytes:\\xNN...``, as OpenAI writes it.

Why incremental: streaming cuts the text where each token completes characters, and a stop string is
found by character position; decoding every prefix of a sample to learn that is quadratic in its length.
The tokenizer's own stream decoder (``tokenizers.decoders.DecodeStream``) says what text each token adds,
once per token, as the full decode would render it.
"""

from __future__ import annotations

import codecs
import json
from bisect import bisect_left

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase


def _byte_alphabet() -> dict[str, int]:
    """The characters a byte-level BPE vocabulary writes each byte as: printable Latin-1 bytes as
    themselves, every other byte shifted past 255, in byte order (the GPT-2 scheme)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


def _decoder_types(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """The types of the fast tokenizer's decoder and of its parts (``Sequence`` decoders hold several)."""
    if not tokenizer.is_fast:
        return set()
    state = json.loads(tokenizer.backend_tokenizer.decoder.__getstate__())
    parts = state.get("decoders", [state])
    return {part["type"] for part in parts}


class TokenText:
    """``tokenizer``'s tokens as bytes and as growing text (see the module's docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        kinds = _decoder_types(tokenizer)
        self.byte_level, self.byte_fallback = "ByteLevel" in kinds, "ByteFallback" in kinds
        self._alphabet = _byte_alphabet()
        self._added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._bytes: dict[int, bytes] = {}

    def decode(self, token_ids: list[int]) -> str:
        """The tokens' text, special tokens written out (what a sample's ``text`` is)."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=False))  # one row: one string

    def token_bytes(self, token_id: int) -> bytes:
        """The raw UTF-8 bytes token ``token_id`` stands for (an added token's: its text's)."""
        found = self._bytes.get(token_id)
        if found is None:
            found = self._bytes[token_id] = self._raw(token_id)
        return found

    def _raw(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):  # one id converts to one token
            raise TypeError(f"convert_ids_to_tokens({token_id}) returned {piece!r}")
        if self.byte_level and all(c in self._alphabet for c in piece):
            return bytes(self._alphabet[c] for c in piece)
        if self.byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if self.byte_fallback:
            return piece.replace("\u2581", " ").encode()  # SentencePiece writes a space as U+2581
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False)).encode()

    def token_string(self, token_id: int) -> str:
        """OpenAI's ``token``: the token's text, or ``bytes:\\xNN...`` when its bytes are not valid UTF-8
        on their own (part of a character)."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def added_text(self, token_ids: list[int]) -> list[str]:
        """The text each token adds to the sample decoded so far (empty while it holds part of a character),
        one pass over the tokens; joined, they are the sample's text."""
        if self.tokenizer.is_fast:
            stream, backend = DecodeStream(skip_special_tokens=False), self.tokenizer.backend_tokenizer
            return [stream.step(backend, token_id) or "" for token_id in token_ids]
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return [utf8.decode(self.token_bytes(token_id)) for token_id in token_ids]

    def char_ends(self, token_ids: list[int]) -> list[int]:
        """How many characters of the text are complete after each token."""
        ends, total = [], 0
        for piece in self.added_text(token_ids):
            total += len(piece)
            ends.append(total)
        return ends

    def pieces(self, token_ids: list[int], text: str) -> list[str]:
        """``text`` (the sample's text, possibly cut: a stop string, the prose before a tool call) cut where
        the tokens complete characters: non-empty chunks that join to exactly ``text``."""
        cuts = [min(end, len(text)) for end in self.char_ends(token_ids)]
        pieces, done = [], 0
        for cut in cuts:
            if cut > done:
                pieces.append(text[done:cut])
                done = cut
        if done < len(text):
            pieces.append(text[done:])
        return pieces

    def tokens_for(self, token_ids: list[int], chars: int) -> int:
        """The fewest leading tokens whose text reaches ``chars`` characters (all of them if none does)."""
        ends = self.char_ends(token_ids)
        return min(bisect_left(ends, chars) + 1, len(token_ids))
