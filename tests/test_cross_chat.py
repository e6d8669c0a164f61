"""The cross-chat index (lookups.CorpusIndex): earlier chats' text for the match source, bounded, and exact: a
forest whose lookup nodes come from other chats keeps the baseline's law (spec §16.7: fixed before the pass)."""

from __future__ import annotations

import time

import pytest

from app.decoding.beams import Stopper
from app.decoding.lookups import MAX_NGRAM, Builder, CorpusIndex
from app.engine.engine import chat_key
from law_helpers import BASELINE, EXACT, law_of, max_gap, params


def test_longest_match_with_counts_across_chats():
    c = CorpusIndex()
    c.add("a", [5, 6, 7, 9, 5, 6, 7, 8])
    c.add("b", [4, 6, 7, 9])
    # "6 7" continues 9 (twice) and 8; "5 6 7" matches longer: 9 and 8 once each
    assert c.propose([1, 6, 7]) == [(9, 2, pytest.approx(2 / 3)), (8, 2, pytest.approx(1 / 3))]
    assert c.propose([5, 6, 7]) == [(8, 3, 0.5), (9, 3, 0.5)]
    assert c.propose([4, 6, 7]) == [(9, 3, 1.0)]
    assert c.propose([4, 6, 7], exclude="b") == [(8, 2, 0.5), (9, 2, 0.5)]
    assert c.propose([7]) == [] and c.propose([3, 3]) == []


def test_bounded_oldest_chats_leave_and_a_grown_chat_replaces_itself():
    c = CorpusIndex(max_tokens=10)
    c.add("old", [1, 2, 3, 4, 5, 6])
    c.add("new", [7, 8, 9, 10, 11, 12])
    assert len(c) == 6 and list(c.docs) == ["new"] and c.propose([1, 2]) == []
    c.add("new", [7, 8, 9, 10, 11, 12, 13])
    assert len(c) == 7 and c.propose([11, 12]) == [(13, 2, 1.0)]
    for i in range(50):  # dropped chats' positions are swept, not kept forever
        c.add(i, [100 + i, 200 + i, 300 + i])
    assert sum(len(v) for v in c.where.values()) <= 2 * len(c) + 10


def test_a_chat_added_again_as_it_grows_counts_each_position_once():
    """A conversation is added again after every answer: its earlier version's positions, the same text at the
    same places, neither count again in a proposal nor stay listed."""
    c = CorpusIndex()
    c.add("chat", [1, 2, 3, 4])
    c.add("other", [2, 3, 5])
    c.add("chat", [1, 2, 3, 4, 6, 7])
    assert c.propose([9, 2, 3]) == [(4, 2, 0.5), (5, 2, 0.5)]
    grown = [(i * 37) % 101 for i in range(300)]
    for turn in range(20):
        grown += [(turn * 13 + i) % 101 for i in range(40)]
        c.add("chat", grown)
        assert sum(len(v) for v in c.where.values()) <= 2 * len(c) + 10


def test_builder_match_source_uses_the_longer_of_prompt_and_corpus():
    corpus = CorpusIndex()
    corpus.add("x", [10, 11, 12, 13, 14, 15])
    b = Builder([1, 2, 10, 11, 99], sources=("match",), corpus=corpus)
    assert [t for t, *_ in b.propose((12, 13))] == [14]  # only the other chat knows "12 13"
    b = Builder([12, 13, 50, 12, 13], sources=("match",), corpus=corpus)
    assert [t for t, *_ in b.propose((11, 12, 13))] == [14]  # the corpus matches 3 tokens, the prompt 2
    assert [t for t, *_ in b.propose((99, 13))] == [50]  # the prompt's own match
    assert Builder([1], sources=("recycled",), corpus=corpus).corpus is None  # match only
    assert Builder([1], sources=("match",), corpus=CorpusIndex()).corpus is None  # empty: nothing to look in


def test_chat_key_follows_a_growing_chat():
    first = list(range(40))
    assert chat_key(first) == chat_key(first + [1, 2, 3]) != chat_key([9] + first)


def test_a_100_kb_file_is_indexed_whole():
    """Its speed is measured by scripts/measure_attachments.py (docs/measurements/attachments.md)."""
    tokens = [(i * 7919) % 30_000 for i in range(25_000)]  # ~100 KB of text is ~25k tokens
    c = CorpusIndex()
    c.add("big", tokens)
    assert c.propose(tokens[100:100 + MAX_NGRAM]) == [(tokens[100 + MAX_NGRAM], MAX_NGRAM, 1.0)]


@pytest.mark.parametrize("replacement,draft", [
    ("without", False),
    pytest.param("with", False, marks=pytest.mark.slow),
    pytest.param("without", True, marks=pytest.mark.slow),
])
def test_nodes_from_other_chats_keep_the_baseline_law_exact(replacement, draft):
    """The builder's own prompt index holds one token, so the match nodes come from the earlier chats."""
    corpus = CorpusIndex()
    corpus.add("a", [1, 2, 2, 1, 2, 1, 1, 2, 0])
    corpus.add("b", [2, 1, 2, 2, 2, 1, 0])

    def builder(p):
        return Builder([1], sources=("match",), corpus=corpus, finished=Stopper(eos_ids=frozenset({0})).finished)

    want, _ = law_of(params(BASELINE[replacement]))
    got, seen = law_of(params("dsbd", replacement=replacement, lookup_nodes=2, gamma=2, lookup_sources=("match",)),
                       draft=draft, builder=builder)
    assert abs(sum(got.values()) - 1) < EXACT
    assert max_gap(got, want) < EXACT
    assert seen["match"] > 1e-3  # the other chats' nodes were really hit


def test_the_engine_remembers_each_chat_once_and_hands_the_index_to_the_next(tiny_gguf_path, monkeypatch):
    from app.config import DecodeParams
    from app.decoding import lookups
    from app.engine.engine import Engine
    from backends.registry import ModelSpec

    handed = []
    real = lookups.Builder.use_corpus
    monkeypatch.setattr(lookups.Builder, "use_corpus",
                        lambda self, corpus, exclude=None: (exclude is not None and handed.append(
                            (len(corpus), exclude)), real(self, corpus, exclude))[1])  # the engine's calls
    engine = Engine.load(ModelSpec(source="tiny", n_ctx=512))
    try:
        p = DecodeParams(mode="dsbd", beams=1, max_new_tokens=6, seed=1, lookup_nodes=2, lookup_sources=("match",))
        chat = [{"role": "user", "content": "Count from one to five, then say which of those numbers are odd, "
                                            "which are even, and which are prime, one line each."}]
        prompt = engine.encode(chat)
        last = list(engine.generate(prompt, p))[-1]
        assert len(engine.corpus) == len(prompt) + last.tokens and handed == [(0, chat_key(prompt))]
        grown = chat + [{"role": "assistant", "content": last.text}, {"role": "user", "content": "Again."}]
        list(engine.generate(engine.encode(grown), p))  # the same chat, grown: it replaces itself
        assert len(engine.corpus.docs) == 1 and handed[-1][1] == chat_key(prompt)
        other = engine.encode([{"role": "user", "content": "Name a colour."}])
        list(engine.generate(other, p))
        assert len(engine.corpus.docs) == 2 and handed[-1] == (handed[-1][0], chat_key(other)) and handed[-1][0] > 0
    finally:
        engine.close()


def _saved_chat(store, question: str, answer: str) -> dict:
    chat = store.new_chat()
    chat["messages"] = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    store.save(chat)
    return chat


def test_saved_chats_fill_the_index_of_a_new_engine_newest_first_within_its_bound(tiny_gguf_path, tmp_path):
    from app.config import DecodeParams
    from app.engine.engine import Engine
    from app.serve.ui.chat import prompt_messages
    from app.storage import HistoryStore
    from backends.registry import ModelSpec

    store = HistoryStore(tmp_path)
    old = _saved_chat(store, "Spell the old word.", "The old word is quarantine, spelt q-u-a-r-a-n-t-i-n-e.")
    time.sleep(0.01)  # `updated` orders them
    new = _saved_chat(store, "Write the function.", "def zebra_crossing(width_m: float) -> int:\n"
                                                     "    return int(width_m // 0.5) + 1\n")
    assert [c["id"] for c in store.recent(10_000)] == [new["id"], old["id"]]
    assert [c["id"] for c in store.recent(1)] == [new["id"]]  # the newest alone already holds that much

    engine = Engine.load(ModelSpec(source="tiny", n_ctx=512))  # a later start: nothing in memory
    try:
        saved = [prompt_messages(c) for c in store.recent(10_000)]
        engine.remember_chats(saved)
        assert len(engine.corpus) == 0  # encoded at the first generation, not at the start
        prompt = engine.encode([{"role": "user", "content": "Hello."}])
        p = DecodeParams(mode="dsbd", beams=1, max_new_tokens=2, seed=1, lookup_nodes=2, lookup_sources=("match",))
        list(engine.generate(prompt, p))
        ids = {chat_key(engine.encode(m)): engine.encode(m) for m in saved}
        assert list(engine.corpus.docs)[:2] == list(ids)[::-1]  # the oldest first: the bound drops it first
        code = engine.tokenizer.encode("def zebra_crossing(width_m")
        want = engine.corpus.docs[chat_key(engine.encode(saved[0]))]
        at = next(i for i in range(len(want)) if tuple(want[i:i + len(code)]) == tuple(code))
        assert engine.corpus.propose(want[:at + len(code)])[0][0] == want[at + len(code)]  # it continues the edit

        newest = chat_key(engine.encode(saved[0]))
        engine.corpus = CorpusIndex(max_tokens=len(ids[newest]) + 5)  # a small bound: only the newest chat fits
        engine._fill_corpus()
        assert list(engine.corpus.docs) == [newest]
    finally:
        engine.close()
