"""Beam bookkeeping shared by every decoder: stop rules, finished pool, final choice, streaming prefix."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class Beam:
    """A candidate continuation: generated tokens and s(y), the raw target log-likelihood."""

    tokens: tuple[int, ...]
    score: float
    finished: bool = False
    # Per token: True when it is a draft token the target accepted (drafted modes; () = no draft involved).
    # Not part of equality: two beams with the same tokens are the same candidate however they were made.
    drafted: tuple[bool, ...] = field(default=(), compare=False)

    def normalized(self, length_penalty: float) -> float:
        """S(y) = s(y) / n^lambda (Hugging Face-style length penalty)."""
        return self.score / max(1, len(self.tokens)) ** length_penalty


class Stopper:
    """Decides when a beam ends: an end-of-generation token or a completed stop string."""

    def __init__(self, *, eos_ids: frozenset[int], stop: Sequence[str] = (), decode=None) -> None:
        self.eos_ids = frozenset(eos_ids)
        self.stop = tuple(stop)
        self._decode = decode  # ids -> bytes; needed only with stop strings
        # A stop string is completed by the newest token, so a bounded tail of tokens suffices.
        self._tail = max((len(s.encode()) for s in self.stop), default=0) + 8
        # The streamed text so far (its tokens, EOS dropped, and their bytes): a stream's prefix only grows, and
        # decode concatenates (the Tokenizer contract), so each call filters and decodes only the new tokens.
        self._shown: tuple[tuple[int, ...], bytes] = ((), b"")

    def finished(self, tokens: Sequence[int]) -> bool:
        if not tokens:
            return False
        if tokens[-1] in self.eos_ids:
            return True
        if self.stop:
            tail = self._decode(list(tokens[-self._tail:])).decode("utf-8", "ignore")
            return any(s in tail for s in self.stop)
        return False

    def visible_text(self, tokens: Sequence[int], *, final: bool, fresh: bool = False) -> str:
        """Text to show: EOS dropped, cut before a stop string; when not final, hold back a tail
        that could still become a stop string and any incomplete UTF-8 sequence. fresh: decode all of `tokens`,
        not only what the last call's did not have (for texts that are not the stream's)."""
        if fresh:
            ids = [t for t in tokens if t not in self.eos_ids]
            data = self._decode(ids) if ids else b""
        else:
            data = self._bytes(tuple(tokens))
        text = data.decode("utf-8", "ignore") if final else _complete_utf8(data)
        if not self.stop:
            return text
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut]
        if not final:
            for s in self.stop:  # hold back a suffix that is a prefix of a stop string
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        text = text[:-k]
                        break
        return text

    def _bytes(self, tokens: tuple[int, ...]) -> bytes:
        """The bytes of `tokens` without EOS: only the tokens past the last call's, when they extend them (one
        compare in C; the answer's length no longer costs Python work per token)."""
        seen, data = self._shown
        n = len(seen)
        if not (n and len(tokens) >= n and tokens[:n] == seen):
            n, data = 0, b""
        ids = [t for t in tokens[n:] if t not in self.eos_ids]
        if ids:
            data += self._decode(ids)
        self._shown = (tokens, data)
        return data

    def runs(self, tokens: Sequence[int], flags: Sequence[bool]) -> list[tuple[str, bool]]:
        """The final visible text of `tokens` cut where `flags` (one per token) changes: [(text, flag)].
        A character split across a boundary goes to the run that completes it."""
        text = self.visible_text(tokens, final=True, fresh=True)
        keep = [(t, bool(f)) for t, f in zip(tokens, flags) if t not in self.eos_ids]
        pieces = [self._decode([t]) for t, _ in keep]
        if b"".join(pieces) == self._decode([t for t, _ in keep]):  # byte-level pieces: one pass, O(n)
            utf8, out = codecs.getincrementaldecoder("utf-8")("ignore"), []
            for (_, f), piece in zip(keep, pieces):
                _append(out, utf8.decode(piece), f)
            if out:
                _append(out, utf8.decode(b"", final=True), out[-1][1])
            return _clip(out, len(text))
        # Pieces that change when joined (a SentencePiece leading space): decode each run boundary's prefix.
        out, i = [], 0
        while i < len(tokens):
            j = i
            while j < len(tokens) and flags[j] == flags[i]:
                j += 1
            done = sum(len(t) for t, _ in out)
            _append(out, text[done:len(self.visible_text(tokens[:j], final=True, fresh=True)) if j < len(tokens) else None],
                     bool(flags[i]))
            i = j
        return _clip(out, len(text))


def _append(runs: list[tuple[str, bool]], text: str, flag: bool) -> None:
    if not text:
        return
    if runs and runs[-1][1] == flag:
        runs[-1] = (runs[-1][0] + text, flag)
    else:
        runs.append((text, flag))


def _clip(runs: list[tuple[str, bool]], n: int) -> list[tuple[str, bool]]:
    """The runs cut to their first n characters (the text ends before a stop string)."""
    out, left = [], n
    for text, flag in runs:
        if left <= 0:
            break
        out.append((text[:left], flag))
        left -= len(text)
    return out


def _complete_utf8(data: bytes) -> str:
    # Drop an incomplete multi-byte sequence at the end; it completes with the next token.
    for k in range(4):
        try:
            return data[: len(data) - k].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", "ignore")


@dataclass
class Pool:
    """Finished candidates of a full-mode beam run: the `size` best by S, duplicates removed."""

    size: int
    length_penalty: float
    beams: list[Beam] = field(default_factory=list)

    def add(self, beam: Beam) -> None:
        if any(b.tokens == beam.tokens for b in self.beams):
            return
        self.beams.append(beam)
        self.beams.sort(key=lambda b: -b.normalized(self.length_penalty))
        del self.beams[self.size:]

    def is_done(self, live: Sequence[Beam]) -> bool:
        """Hugging Face's default heuristic: a full pool whose worst beats the best live beam."""
        if len(self.beams) < self.size or not live:
            return False
        best_live = max(b.normalized(self.length_penalty) for b in live)
        return best_live <= self.beams[-1].normalized(self.length_penalty)


def final_choice(pool: Sequence[Beam], live: Sequence[Beam], length_penalty: float) -> Beam:
    """Argmax of S over finished then live candidates (ties: finished first, then lower slot)."""
    candidates = list(pool) + list(live)
    best = max(range(len(candidates)), key=lambda i: (candidates[i].normalized(length_penalty), -i))
    return candidates[best]


def common_prefix(seqs: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """Longest common prefix: the tokens every still-returnable sequence contains. Compared a slice at a time
    (in C), so a long answer costs no Python loop over its tokens at every step."""
    if not seqs:
        return ()
    first = tuple(seqs[0])
    n = min(len(s) for s in seqs)
    for s in seqs[1:]:
        s = tuple(s)
        if s[:n] == first[:n]:
            continue
        i, block = 0, 64
        while block:  # the longest equal run, in blocks of 64, then 8, then 1
            while i + block <= n and s[i:i + block] == first[i:i + block]:
                i += block
            block //= 8
        n = i
    return first[:n]
