"""``logit_bias`` in the sampler (engine/sampling/sampler.py) and its parsing (engine/io_struct.py): added per row,
only to the rows that have one, the bounds a ban and an exclusive choice, under a grammar's mask, never in the
logprobs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixserve.engine.io_struct import (
    LOGIT_BIAS_HARD,
    MAX_LOGIT_BIAS_ENTRIES,
    InvalidRequestError,
    SamplingParams,
    parse_logit_bias,
)
from radixserve.engine.sampling.sampler import apply_logit_bias, apply_token_bitmask, sample

VOCAB = 64


def params(bias: dict[str, float] | None = None, **kw: object) -> SamplingParams:
    sp = SamplingParams(logit_bias=bias, **kw)  # type: ignore[arg-type]
    sp.validate(VOCAB)
    return sp


def run(logits: torch.Tensor, ps: list[SamplingParams], lp: bool = False, processor=None):  # type: ignore[no-untyped-def]
    b = len(ps)
    return sample(logits, ps, [[] for _ in range(b)], [[] for _ in range(b)], [None] * b, [lp] * b, [2] * b, processor)


def logits_rows(b: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, VOCAB, generator=g) * 5


def test_parse_keeps_order_and_maps_the_bounds():
    assert parse_logit_bias({"5": 1.5, "0": -100, "63": 100, "7": 0}, VOCAB) == (
        [5, 0, 63, 7],
        [1.5, -LOGIT_BIAS_HARD, LOGIT_BIAS_HARD, 0.0],
    )


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"a": 1}, "decimal"),
        ({"007": 1}, "decimal"),
        ({"-3": 1}, "decimal"),
        ({"\u0663": 1}, "decimal"),  # an Arabic-Indic digit: isdigit() but not a JSON-style id
        ({"64": 1}, "outside the vocabulary"),
        ({"9" * 5000: 1}, "decimal"),  # int() would raise ValueError on over 4300 digits
        ({"": 1}, "decimal"),
        ({"1": float("nan")}, "[-100, 100]"),
        ({"1": float("inf")}, "[-100, 100]"),
        ({"1": 100.01}, "[-100, 100]"),
        ({"1": True}, "[-100, 100]"),
        ([("1", 2)], "object"),
    ],
)
def test_parse_refuses(raw, needle):
    with pytest.raises(InvalidRequestError) as e:
        parse_logit_bias(raw, VOCAB)
    assert e.value.param == "logit_bias" and needle in e.value.message


def test_parse_refuses_too_many_entries():
    with pytest.raises(InvalidRequestError, match="at most"):
        parse_logit_bias({str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}, None)
    assert len(parse_logit_bias({str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES)}, None)[0]) == MAX_LOGIT_BIAS_ENTRIES


def test_rows_without_bias_are_untouched_and_cost_nothing(monkeypatch):
    logits = logits_rows(3)
    plain = logits.clone()
    ps = [params(temperature=0), params({"3": 2.5, "9": -1}, temperature=0), params(temperature=0)]
    apply_logit_bias(logits, ps)
    assert torch.equal(logits[0], plain[0]) and torch.equal(logits[2], plain[2])
    expected = plain[1].clone()
    expected[3] += 2.5
    expected[9] -= 1
    assert torch.equal(logits[1], expected)

    def boom(self: SamplingParams) -> None:
        raise AssertionError("bias_entries read for a request without logit_bias")

    monkeypatch.setattr(SamplingParams, "bias_entries", boom)
    apply_logit_bias(logits_rows(2), [params(), params({})])


def test_bounds_ban_and_force_greedy_and_sampled():
    logits = logits_rows(4, seed=1)
    top = logits.argmax(dim=-1).tolist()
    ps = [
        params({str(top[0]): -100}, temperature=0),
        params({"11": 100}, temperature=0),
        params({"11": 100, "12": 100}, temperature=2.0),
        params({str(top[3]): -100}, temperature=5.0),
    ]
    for _ in range(20):
        ids = run(logits.clone(), ps).next_token_ids
        assert ids[0] != top[0] and ids[1] == 11 and ids[2] in (11, 12) and ids[3] != top[3]


def test_logprobs_are_those_of_the_raw_logits():
    logits = logits_rows(1, seed=2)
    raw = torch.log_softmax(logits[0], dim=-1)
    out = run(logits.clone(), [params({"20": 100}, temperature=0)], lp=True)
    (lp,) = out.logprobs
    assert out.next_token_ids == [20] and lp is not None
    assert lp.logprob == pytest.approx(raw[20].item(), abs=1e-5)


def test_grammar_mask_wins_and_a_ban_leaves_no_dead_end():
    """A +100 token the grammar forbids stays forbidden; the one token a grammar allows is chosen even when banned."""
    words = (VOCAB + 31) // 32
    mask = torch.zeros(2, words, dtype=torch.int32)
    mask[0, 0] = (1 << 4) | (1 << 5)  # row 0 allows tokens 4 and 5
    mask[1, 0] = 1 << 6  # row 1 allows token 6 only
    ps = [params({"11": 100}, temperature=1.0), params({"6": -100}, temperature=1.0)]
    for _ in range(10):
        ids = run(logits_rows(2, seed=3), ps, processor=lambda x: apply_token_bitmask(x, mask, [0, 1])).next_token_ids
        assert ids[0] in (4, 5) and ids[1] == 6


def test_a_copied_params_keeps_its_bias():
    """``dataclasses.replace`` (the completions endpoint copies params per prompt) re-parses the bias lazily."""
    sp = dataclasses.replace(params({"8": 100}, temperature=0), max_new_tokens=3)
    assert run(logits_rows(1), [sp]).next_token_ids == [8]
