"""Deterministic synthetic text data for the example recipes.

Everything here is generated in-process from a seeded ``random.Random`` so every
machine sees byte-identical data without downloads or files on disk; that is what
lets recipes and tests check exact-resume behaviour across restarts and hosts.
"""

from __future__ import annotations

import functools
import random
import string

import torch
from torch.utils.data import Dataset

__all__ = ["CharTokenizer", "TextDataset", "build_dataset", "generate_corpus"]

# ---------------------------------------------------------------------------
# Word lists. Tuples (never sets or dicts) so iteration order, and therefore the
# corpus, cannot depend on hash randomisation.
# ---------------------------------------------------------------------------


def _words(text: str) -> tuple[str, ...]:
    """Split a whitespace-separated word list (keeps the long lists compact)."""
    return tuple(text.split())


def _verb_pairs(text: str) -> tuple[tuple[str, str], ...]:
    """Parse ``base:past`` tokens into ``(base, past)`` pairs."""
    pairs = []
    for token in text.split():
        base, past = token.split(":")
        pairs.append((base, past))
    return tuple(pairs)


_NOUNS: tuple[str, ...] = _words(
    """
    river garden village lantern window traveler merchant child teacher sailor farmer
    soldier captain doctor painter king queen stranger horse dog cat bird wolf fox owl
    letter book map key door road bridge tower castle forest mountain valley storm fire
    shadow mirror clock candle ship harbor island market kitchen table chair basket coat
    hat boot sword shield song story dream secret promise question answer morning
    evening winter summer festival wagon well stone field orchard cottage chapel library
    scholar widow miller baker blacksmith shepherd fisherman musician poet thief guard
    servant priest friend brother sister mother father neighbor stair
    """
)

_PLURALS: tuple[str, ...] = _words(
    """
    children people men women horses birds stars clouds leaves apples coins boats
    soldiers sailors letters flowers candles travelers merchants sheep geese wolves
    bells lamps pages
    """
)

_NAMES: tuple[str, ...] = _words(
    """
    Anna Thomas Margaret Elias Clara Jonah Beatrice Samuel Iris Felix Rosalind Hugo
    Martha Oliver Lucy Edmund Nora Walter Greta Arthur
    """
)

# Multi-word entries, so an explicit tuple rather than a split string.
_PLACES: tuple[str, ...] = (
    "Ashford",
    "Millbrook",
    "the northern hills",
    "Greywater",
    "the old quarter",
    "Lindenfield",
    "the coast",
    "Harrow Cross",
    "the capital",
    "Elmstead",
)

_ADJECTIVES: tuple[str, ...] = _words(
    """
    old young quiet bright dark cold warm small large tall narrow wide strange gentle
    fierce tired hungry clever foolish proud humble silent golden silver broken hidden
    distant ancient empty crowded green grey red blue white heavy careful honest patient
    restless lonely cheerful solemn wooden crooked curious sudden faint pale wild
    """
)

_ADVERBS: tuple[str, ...] = _words(
    """
    slowly quickly quietly carefully suddenly softly happily sadly gently bravely
    eagerly calmly nervously patiently once often again finally almost nearly
    """
)

# "base:past" pairs for verbs that take a direct object.
_TRANSITIVE: tuple[tuple[str, str], ...] = _verb_pairs(
    """
    carry:carried find:found open:opened close:closed watch:watched follow:followed
    build:built break:broke hold:held see:saw hear:heard remember:remembered
    forget:forgot mend:mended paint:painted read:read write:wrote sell:sold buy:bought
    hide:hid greet:greeted call:called leave:left take:took bring:brought lose:lost
    keep:kept visit:visited guard:guarded praise:praised question:questioned
    answer:answered describe:described study:studied admire:admired ignore:ignored
    """
)

# "base:past" pairs for verbs used without an object.
_INTRANSITIVE: tuple[tuple[str, str], ...] = _verb_pairs(
    """
    walk:walked run:ran sleep:slept wait:waited laugh:laughed cry:cried sing:sang
    dance:danced rest:rested arrive:arrived wander:wandered listen:listened
    shiver:shivered smile:smiled whisper:whispered hesitate:hesitated return:returned
    vanish:vanished kneel:knelt pray:prayed sigh:sighed travel:traveled
    """
)

_SPEECH_VERBS: tuple[str, ...] = _words(
    """
    said asked replied whispered answered shouted murmured added
    """
)

_PREPOSITIONS: tuple[str, ...] = _words(
    """
    across beside behind near under over through toward past along inside beyond around
    into
    """
)

_TIME_PHRASES: tuple[str, ...] = (
    "at dawn",
    "before noon",
    "after supper",
    "in the spring",
    "late that night",
    "on the third day",
    "in the autumn of that year",
    "the next morning",
    "at midnight",
    "long ago",
    "by evening",
    "during the storm",
)

_SUBORDINATORS: tuple[str, ...] = _words(
    """
    When Because Although After Before While Since Until If
    """
)

_CONJUNCTIONS: tuple[str, ...] = _words(
    """
    and but so yet or
    """
)

_NUMBER_WORDS: tuple[str, ...] = (
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "twelve",
    "twenty",
    "a hundred",
)

_THOUGHTS: tuple[str, ...] = (
    "nothing lasts forever",
    "the road was longer than it looked",
    "someone was watching",
    "the answer had been there all along",
    "it would rain before dark",
    "no one would believe the story",
    "the old ways were best",
    "they were not alone",
)

_ROMAN: tuple[tuple[int, str], ...] = (
    (1000, "M"),
    (900, "CM"),
    (500, "D"),
    (400, "CD"),
    (100, "C"),
    (90, "XC"),
    (50, "L"),
    (40, "XL"),
    (10, "X"),
    (9, "IX"),
    (5, "V"),
    (4, "IV"),
    (1, "I"),
)


def _roman(n: int) -> str:
    out = []
    for value, numeral in _ROMAN:
        while n >= value:
            out.append(numeral)
            n -= value
    return "".join(out)


def _wrap(text: str, width: int = 72) -> str:
    """Greedy word wrap; hand-rolled so output never depends on textwrap's version."""
    lines: list[str] = []
    current = ""
    for word in text.split(" "):
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    if current:
        lines.append(current)
    return "\n".join(lines)


class _ProseGenerator:
    """Tiny phrase-structure grammar. Uses only ``self.rng`` (never ``random.*``).

    Only ``random()``, ``choice()`` and ``randint()`` are used: their algorithms
    have been stable across CPython 3.x, which keeps the corpus identical everywhere.
    """

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.chapter = 0

    def _maybe(self, p: float) -> bool:
        return self.rng.random() < p

    def noun_phrase(self) -> str:
        rng = self.rng
        r = rng.random()
        if r < 0.15:
            return rng.choice(_NAMES)
        if r < 0.25:
            quantity = rng.choice(("the", "some", "many", "number"))
            if quantity == "number":
                quantity = rng.choice(_NUMBER_WORDS)
            adj = f"{rng.choice(_ADJECTIVES)} " if self._maybe(0.5) else ""
            return f"{quantity} {adj}{rng.choice(_PLURALS)}"
        det = rng.choice(("the", "the", "a", "his", "her", "their", "that"))
        adj = ""
        if self._maybe(0.45):
            adj = rng.choice(_ADJECTIVES) + " "
            if self._maybe(0.15):
                adj = f"{rng.choice(_ADJECTIVES)}, {adj}"
        noun = rng.choice(_NOUNS)
        if det == "a" and (adj or noun)[0] in "aeiou":
            det = "an"
        return f"{det} {adj}{noun}"

    def prep_phrase(self) -> str:
        if self._maybe(0.2):
            prep = self.rng.choice(("in", "near", "beyond", "toward"))
            return f"{prep} {self.rng.choice(_PLACES)}"
        return f"{self.rng.choice(_PREPOSITIONS)} {self.noun_phrase()}"

    def clause(self) -> str:
        rng = self.rng
        subject = self.noun_phrase()
        if self._maybe(0.55):
            verb = rng.choice(_TRANSITIVE)[1]
            body = f"{subject} {verb} {self.noun_phrase()}"
        else:
            verb = rng.choice(_INTRANSITIVE)[1]
            body = f"{subject} {verb}"
            if self._maybe(0.4):
                body += f" {rng.choice(_ADVERBS)}"
        if self._maybe(0.45):
            body += f" {self.prep_phrase()}"
        if self._maybe(0.15):
            body += f" {rng.choice(_TIME_PHRASES)}"
        return body

    def sentence(self) -> str:
        rng = self.rng
        r = rng.random()
        if r < 0.30:
            s = self.clause() + "."
        elif r < 0.45:
            s = f"{self.clause()}, {rng.choice(_CONJUNCTIONS)} {self.clause()}."
        elif r < 0.57:
            s = f"{rng.choice(_SUBORDINATORS)} {self.clause()}, {self.clause()}."
        elif r < 0.65:
            s = f"{rng.choice(_TIME_PHRASES)}, {self.clause()}."
        elif r < 0.73:
            s = self.question()
        elif r < 0.85:
            s = self.dialogue()
        elif r < 0.90:
            s = self.listing()
        elif r < 0.94:
            s = f"{rng.choice(_NAMES)} knew that {rng.choice(_THOUGHTS)}; {self.clause()}."
        elif r < 0.97:
            adj = rng.choice(_ADJECTIVES)
            s = f"What {'an' if adj[0] in 'aeiou' else 'a'} {adj} {rng.choice(_NOUNS)} it was!"
        else:
            year = rng.randint(1701, 1899)
            s = f"In {year}, {self.clause()} - or so the {rng.choice(_NOUNS)} claimed."
        return s[0].upper() + s[1:]

    def question(self) -> str:
        rng = self.rng
        r = rng.random()
        if r < 0.4:
            return f"did {self.noun_phrase()} {rng.choice(_TRANSITIVE)[0]} {self.noun_phrase()}?"
        if r < 0.7:
            wh = rng.choice(("why", "where", "when", "how"))
            return f"{wh} did {self.noun_phrase()} {rng.choice(_INTRANSITIVE)[0]}?"
        return f"who {rng.choice(_TRANSITIVE)[1]} {self.noun_phrase()}?"

    def dialogue(self) -> str:
        rng = self.rng
        speaker = rng.choice(_NAMES)
        verb = rng.choice(_SPEECH_VERBS)
        inner = self.clause()
        inner = inner[0].upper() + inner[1:]
        if self._maybe(0.3):
            q = self.question()
            return f'"{q[0].upper()}{q[1:]}" {verb} {speaker}.'
        if self._maybe(0.5):
            return f'"{inner}," {verb} {speaker}.'
        end = "!" if self._maybe(0.2) else "."
        return f'{speaker} {verb}, "{inner}{end}"'

    def listing(self) -> str:
        rng = self.rng
        items = [self.noun_phrase() for _ in range(rng.randint(2, 4))]
        if len(items) > 2:
            listed = ", ".join(items[:-1]) + f", and {items[-1]}"  # Oxford comma
        else:
            listed = " and ".join(items)
        return f"{self.noun_phrase()} {rng.choice(_TRANSITIVE)[1]} {listed}."

    def paragraph(self) -> str:
        if self._maybe(0.04):
            self.chapter += 1
            return f"CHAPTER {_roman(self.chapter)}"
        sentences = [self.sentence() for _ in range(self.rng.randint(2, 7))]
        return _wrap(" ".join(sentences))


def generate_corpus(num_chars: int = 300_000, seed: int = 1234) -> str:
    """Return ``num_chars`` characters of deterministic English-like prose.

    Paragraphs are generated until the target length is reached and then the text
    is truncated, so a shorter corpus is always a prefix of a longer one with the
    same seed.
    """
    if num_chars < 0:
        raise ValueError(f"num_chars must be >= 0, got {num_chars}")
    gen = _ProseGenerator(seed)
    parts: list[str] = []
    total = 0
    while total < num_chars:
        para = gen.paragraph() + "\n\n"
        parts.append(para)
        total += len(para)
    return "".join(parts)[:num_chars]


# Fixed alphabet rather than "characters seen in the corpus": the vocabulary (and
# thus the model's embedding shape and checkpoints) must not depend on the data.
_ALPHABET: str = "\n " + string.digits + string.ascii_letters + string.punctuation


class CharTokenizer:
    """Character-level tokenizer over a fixed 96-symbol printable-ASCII alphabet."""

    def __init__(self) -> None:
        self.alphabet: str = _ALPHABET
        self._stoi: dict[str, int] = {ch: i for i, ch in enumerate(self.alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        """Map text to token ids; raises ``ValueError`` on characters outside the alphabet."""
        try:
            return [self._stoi[ch] for ch in text]
        except KeyError as exc:
            msg = f"character {exc.args[0]!r} is not in the tokenizer alphabet"
            raise ValueError(msg) from None

    def decode(self, ids: list[int]) -> str:
        """Map token ids back to text."""
        return "".join(self.alphabet[i] for i in ids)


class TextDataset(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """Non-overlapping next-token windows over a 1-D token tensor.

    Item ``i`` is ``(i, x, y)`` where ``x = data[i*B : i*B+B]`` and ``y`` is ``x``
    shifted by one token. The index is returned so tests can record exactly which
    samples a (resumed) run consumed.
    """

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        if data.dim() != 1:
            raise ValueError(f"data must be 1-D, got shape {tuple(data.shape)}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.data = data.to(torch.int64)
        self.block_size = block_size

    def __len__(self) -> int:
        # The -1 reserves the extra token the last window's target needs.
        return max(0, (len(self.data) - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        n = len(self)
        if not -n <= i < n:
            # IndexError (not a silent short slice) so iteration and samplers stop cleanly.
            raise IndexError(f"index {i} out of range for dataset of length {n}")
        i = i % n
        start = i * self.block_size
        chunk = self.data[start : start + self.block_size + 1]
        return i, chunk[:-1].clone(), chunk[1:].clone()


@functools.lru_cache(maxsize=8)
def _cached_corpus(num_chars: int, seed: int) -> str:
    # In-process cache only: avoids regenerating for every rank/test in one process.
    return generate_corpus(num_chars, seed)


def build_dataset(
    block_size: int = 64, num_chars: int = 300_000, seed: int = 1234
) -> tuple[TextDataset, CharTokenizer]:
    """Build the synthetic corpus, tokenize it, and wrap it in a ``TextDataset``."""
    tokenizer = CharTokenizer()
    text = _cached_corpus(num_chars, seed)
    data = torch.tensor(tokenizer.encode(text), dtype=torch.int64)
    return TextDataset(data, block_size), tokenizer
