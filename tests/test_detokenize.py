"""Tests for incremental detokenization (engine/tokenizer/detokenize.py) and stop strings (engine/tokenizer/stop.py).

The detokenizer is checked against the full ``tokenizer.decode`` on the real SmolLM2 tokenizer (ByteLevel BPE, where
emoji / CJK characters span several tokens) and on a small SentencePiece-style tokenizer built here (Metaspace pieces,
byte fallback ``<0xNN>`` tokens, the Llama decoder that strips the first leading space).
"""

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from radixserve.engine.tokenizer.detokenize import IncrementalDetokenizer
from radixserve.engine.tokenizer.stop import StopStringMatcher

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"

pytestmark = pytest.mark.timeout(300)

SAMPLES = [
    "Hello, world! How are you today?",
    "Emoji: 😀👍🏽🎉 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 done",
    "日本語のテキストと中文文本，还有한국어도 있습니다。",
    "Accents: café, naïve, Ångström, São Paulo, Øresund, façade",
    "  leading spaces and\ttabs\nnew lines\n\n  indented",
    "Mixed: x² + y² = z² ≤ ∞ — “quotes” ‘single’ … 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def hf_tok():
    if not (MODEL_DIR / "tokenizer.json").exists():
        pytest.skip("demo model tokenizer not converted")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


def stream(tok, ids, chunks, skip_special_tokens=True, prompt_tail=None):
    """Feed ``ids`` split at ``chunks`` sizes; return (list of emitted pieces, detokenizer)."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens, prompt_tail=prompt_tail)
    pieces, pos = [], 0
    for size in chunks:
        pieces.append(detok.add_tokens(ids[pos : pos + size]))
        pos += size
    assert pos == len(ids)
    pieces.append(detok.flush())
    return pieces, detok


def random_chunks(n, rng):
    sizes = []
    while n > 0:
        s = min(n, rng.randint(1, 5))
        sizes.append(s)
        n -= s
    return sizes


def check_stream(tok, ids, chunks, skip_special_tokens=True, exact_hold=True):
    pieces, detok = stream(tok, ids, chunks, skip_special_tokens)
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(pieces) == full
    assert detok.output_text == full
    if "\ufffd" not in full:
        # Never half a character: no piece carries a replacement character when the full text has none.
        assert all("\ufffd" not in p for p in pieces[:-1]), pieces
    # Every emitted prefix is final: it is a prefix of the full decode.
    acc = ""
    for p in pieces:
        acc += p
        assert full.startswith(acc)
    if exact_hold and "\ufffd" not in full and all(c == 1 for c in chunks):
        # Fed one token at a time, the stream holds back exactly the trailing incomplete character, nothing more.
        # (ByteLevel only: ByteFallback decodes an unfinished byte run as all U+FFFD, earlier bytes included.)
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
        for k, t in enumerate(ids, 1):
            detok.add_tokens([t])
            prefix_text = tok.decode(ids[:k], skip_special_tokens=skip_special_tokens)
            assert detok.output_text == prefix_text.rstrip("\ufffd")
    return pieces


@pytest.mark.parametrize("text", SAMPLES)
def test_real_tokenizer_one_token_at_a_time(hf_tok, text):
    ids = hf_tok.encode(text, add_special_tokens=False)
    pieces = check_stream(hf_tok, ids, [1] * len(ids))
    if any(ord(c) > 0x7FF for c in text):
        # Multi-token characters really were held back at least once (an empty piece) and still came out whole.
        assert "" in pieces[:-1]


@pytest.mark.parametrize("text", SAMPLES)
def test_real_tokenizer_random_chunks(hf_tok, text):
    ids = hf_tok.encode(text, add_special_tokens=False)
    rng = random.Random(text)
    for _ in range(5):
        check_stream(hf_tok, ids, random_chunks(len(ids), rng))


def test_special_tokens_skipped_or_kept(hf_tok):
    ids = hf_tok.encode("Hi there 😀", add_special_tokens=False)
    ids = [1] + ids[:2] + [2] + ids[2:] + [2]  # <|im_start|> ... <|im_end|> ...
    for skip in (True, False):
        pieces = check_stream(hf_tok, ids, [1] * len(ids), skip_special_tokens=skip)
        assert ("<|im_end|>" in "".join(pieces)) is (not skip)


def test_prompt_tail_gives_context_only(hf_tok):
    prompt = hf_tok.encode("The answer is", add_special_tokens=False)
    out = hf_tok.encode(" forty-two 🎉 ok", add_special_tokens=False)
    pieces, detok = stream(hf_tok, out, [1] * len(out), prompt_tail=prompt[-3:])
    expected = hf_tok.decode(prompt[-3:] + out)[len(hf_tok.decode(prompt[-3:])) :]
    assert "".join(pieces) == expected == " forty-two 🎉 ok"


def test_half_character_is_held_then_released(hf_tok):
    ids = hf_tok.encode("Hi 😀!", add_special_tokens=False)
    detok = IncrementalDetokenizer(hf_tok)
    pieces = [detok.add_tokens([t]) for t in ids]
    # The emoji spans several ByteLevel tokens: its first part yields at most the space before it, never U+FFFD,
    # and the whole character arrives in one piece.
    assert len(ids) >= 4
    assert pieces[0] == "Hi" and pieces[1] in ("", " ")
    assert "😀" in pieces[2:-1] or " 😀" in pieces[2:-1]
    assert detok.flush() == "" and detok.output_text == "Hi 😀!"


def test_chunk_emits_stable_text_before_incomplete_character(hf_tok):
    ids = hf_tok.encode("ab 😀", add_special_tokens=False)
    assert hf_tok.decode(ids[:-1]).endswith("\ufffd")
    detok = IncrementalDetokenizer(hf_tok)
    first = detok.add_tokens(ids[:-1])  # ends inside the emoji: everything before it is final
    assert first == "ab "
    assert detok.add_tokens(ids[-1:]) == "😀"


def test_flush_returns_dangling_bytes(hf_tok):
    ids = hf_tok.encode("ok 😀", add_special_tokens=False)[:-1]  # generation ended mid-character
    pieces = check_stream(hf_tok, ids, [1] * len(ids))
    assert pieces[-1].endswith("\ufffd")


PRINTABLE = st.text(
    alphabet=st.one_of(
        st.characters(min_codepoint=0x20, max_codepoint=0x7E),
        st.sampled_from(list("éèüßñçøåÆŒ日本語中文한국어😀🎉👍🏽🇫🇷—…“”\n\t ")),
    ),
    min_size=0,
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=PRINTABLE, seed=st.integers(0, 2**16))
def test_hypothesis_encoded_text(hf_tok, text, seed):
    ids = hf_tok.encode(text, add_special_tokens=False)
    check_stream(hf_tok, ids, random_chunks(len(ids), random.Random(seed)))
    check_stream(hf_tok, ids, [1] * len(ids))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 49151), max_size=25), seed=st.integers(0, 2**16), skip=st.booleans())
def test_hypothesis_arbitrary_token_ids(hf_tok, ids, seed, skip):
    # Arbitrary ids give arbitrary byte sequences (invalid UTF-8 included) and special tokens.
    check_stream(hf_tok, ids, random_chunks(len(ids), random.Random(seed)), skip_special_tokens=skip)


@pytest.fixture(scope="module")
def sp_tok():
    """A SentencePiece-style tokenizer: ▁ word pieces, <0xNN> byte fallback, the Llama decoder (strips one leading
    space of the whole text)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "▁Hello", "▁world", "Hello", "!", "▁caf", "é", "▁日本", "語", "▁the", "s", "▁▁", "ing"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def test_sentencepiece_leading_space_and_byte_fallback(sp_tok):
    v = sp_tok.get_vocab()
    emoji = [v[f"<0x{b:02X}>"] for b in "😀".encode()]
    ids = [v["▁Hello"], v["▁world"], v["!"], v["▁"]] + emoji + [v["▁caf"], v["é"], v["▁日本"], v["語"]]
    full = sp_tok.decode(ids)
    assert full == "Hello world! 😀 café 日本語"  # the decoder really strips the first leading space
    check_stream(sp_tok, ids, [1] * len(ids), exact_hold=False)
    check_stream(sp_tok, ids, [3, 1, 4, 2, 2])


def test_sentencepiece_prompt_tail_keeps_leading_space(sp_tok):
    v = sp_tok.get_vocab()
    tail, out = [v["▁Hello"]], [v["▁world"], v["!"]]
    assert "".join(stream(sp_tok, out, [1, 1])[0]) == "world!"  # alone, the decoder strips the first space
    assert "".join(stream(sp_tok, out, [1, 1], prompt_tail=tail)[0]) == " world!"


def test_sentencepiece_byte_run_fed_one_at_a_time(sp_tok):
    # Found by CI's hypothesis run: "0" then U+0080 spelled <0x30><0xC2><0x80>. ByteFallback decodes the unfinished
    # run "0\xC2" as U+FFFD for every byte, so the stream may hold "0" back; it must still end exactly right.
    v = sp_tok.get_vocab()
    ids = [v["<0x30>"], v["<0xC2>"], v["<0x80>"]]
    pieces = check_stream(sp_tok, ids, [1, 1, 1], exact_hold=False)
    assert "".join(pieces) == "0\u0080"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_hypothesis_sentencepiece_ids(sp_tok, data, skip):
    # Output made of whole units: word pieces, special tokens, or one character spelled as <0xNN> byte tokens (valid
    # UTF-8, as a model emits; an invalid byte run makes the ByteFallback decoder replace *every* byte of the run,
    # including bytes decoded earlier, which no streaming decoder can reproduce).
    v = sp_tok.get_vocab()
    pieces = [t for t in v if not t.startswith("<")]
    units = st.one_of(
        st.sampled_from(pieces).map(lambda t: [v[t]]),
        st.sampled_from(["<s>", "</s>", "<unk>"]).map(lambda t: [v[t]]),
        st.characters(min_codepoint=0x20, max_codepoint=0x1F9FF, exclude_categories=("Cs",)).map(
            lambda c: [v[f"<0x{b:02X}>"] for b in c.encode()]
        ),
    )
    ids = [t for unit in data.draw(st.lists(units, max_size=15)) for t in unit]
    seed = data.draw(st.integers(0, 2**16))
    # exact_hold is a ByteLevel property (see check_stream); random chunks can come out all ones, so say it here too.
    check_stream(sp_tok, ids, random_chunks(len(ids), random.Random(seed)), skip_special_tokens=skip, exact_hold=False)
    check_stream(sp_tok, ids, [1] * len(ids), skip_special_tokens=skip, exact_hold=False)


# ---------------------------------------------------------------------------------------------------- stop strings


def reference_stop(text, stops, trim=True):
    """(expected emitted text, matched stop): the occurrence that ends first; on a tie the longest one."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0:
            key = (i + len(s), -len(s))
            if best is None or key < best[0]:
                best = (key, i, s)
    if best is None:
        return text, None
    _, i, s = best
    return (text[:i] if trim else text[: i + len(s)]), s


def run_matcher(stops, chunks, trim=True):
    m = StopStringMatcher(stops, trim=trim)
    emitted, matched = [], None
    for c in chunks:
        out, matched = m.feed(c)
        emitted.append(out)
        if matched is not None:
            break
    if matched is None:
        emitted.append(m.flush())
    return emitted, matched


def split_at(text, cuts):
    cuts = sorted(set(c for c in cuts if 0 < c < len(text)))
    bounds = [0] + cuts + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_stop_split_across_chunks_is_held_back():
    m = StopStringMatcher(["</end>"])
    assert m.feed("Hello </") == ("Hello ", None)
    assert m.feed("en") == ("", None)
    assert m.feed("d> tail") == ("", "</end>")


def test_false_start_is_released():
    m = StopStringMatcher(["STOP"])
    assert m.feed("ST") == ("", None)
    assert m.feed("ART") == ("START", None)
    assert m.feed("x ST") == ("x ", None)
    assert m.flush() == "ST"


def test_no_stop_trim_includes_stop():
    m = StopStringMatcher(["\n\n"], trim=False)
    assert m.feed("a\n") == ("a", None)
    assert m.feed("\nb") == ("\n\n", "\n\n")


def test_earliest_ending_stop_wins_and_longest_on_tie():
    # "b" completes before "abc" could: generation stops there, whatever the chunking.
    assert run_matcher(["abc", "b"], ["abc"]) == (["a"], "b")
    assert run_matcher(["abc", "b"], ["a", "b", "c"]) == (["", "a"], "b")
    # Same end position: the longer stop (earlier start) is reported.
    assert run_matcher(["bc", "abc"], ["xxabcyy"]) == (["xx"], "abc")


def test_no_stops_passes_through():
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", None)
    assert m.flush() == ""


def test_feed_after_match_raises():
    m = StopStringMatcher(["x"])
    assert m.feed("axb") == ("a", "x")
    with pytest.raises(RuntimeError):
        m.feed("more")


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc \n", max_size=30),
    stops=st.lists(st.text(alphabet="abc \n", min_size=1, max_size=4), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 30), max_size=10),
    trim=st.booleans(),
)
def test_hypothesis_stop_matcher(text, stops, cuts, trim):
    expected, expected_stop = reference_stop(text, stops, trim)
    emitted, matched = run_matcher(stops, split_at(text, cuts), trim)
    assert matched == expected_stop
    assert "".join(emitted) == expected
    # No prefix of the stream ever contains a stop string (with no_stop_trim only the final piece may).
    acc = ""
    pieces = emitted if (trim or matched is None) else emitted[:-1]
    for p in pieces:
        acc += p
        assert not any(s in acc for s in stops)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab", max_size=20),
    stops=st.lists(st.text(alphabet="ab", min_size=2, max_size=5), min_size=1, max_size=3),
)
def test_hypothesis_holds_back_only_possible_stop_prefixes(text, stops):
    # Fed one character at a time, the held-back text is exactly the longest suffix that is a proper prefix of a stop.
    m = StopStringMatcher(stops)
    fed, out = "", ""
    for ch in text:
        fed += ch
        piece, matched = m.feed(ch)
        out += piece
        if matched:
            return
        held = fed[len(out) :]
        assert fed.startswith(out)
        longest = max(
            (k for k in range(len(fed) + 1) if any(len(s) > k and s.startswith(fed[len(fed) - k :]) for s in stops)),
        )
        assert len(held) == longest
