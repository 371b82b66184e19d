"""Tests for engine/sampling/sampler.py: penalties, greedy, filtering, seeded draws, logprobs, NaN/inf safety.

References: HF transformers' logits processors (RepetitionPenalty, TopK, TopP, MinP) and OpenAI's definition of
presence / frequency penalties, computed densely here and compared with the sparse implementation.
"""

import math
import random

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from radixserve.engine.io_struct import SamplingParams
from radixserve.engine.sampling import sampler as sampler_mod
from radixserve.engine.sampling.sampler import apply_penalties, sample

torch.set_num_threads(2)

pytestmark = pytest.mark.timeout(120)


def run(logits, params, outputs=None, prompts=None, gens=None, lp=None, top=None):
    b = logits.shape[0]
    return sample(
        logits,
        params,
        outputs if outputs is not None else [[] for _ in range(b)],
        prompts if prompts is not None else [[] for _ in range(b)],
        gens if gens is not None else [None] * b,
        lp if lp is not None else [False] * b,
        top if top is not None else [0] * b,
    )


def test_greedy_is_argmax_and_ignores_rng():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 100, generator=g)
    params = [SamplingParams(temperature=0.0) for _ in range(4)] + [SamplingParams(temperature=1e-6)]
    out = run(logits.clone(), params)
    assert out.next_token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 5


def test_top_k_one_is_greedy():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    out = run(logits.clone(), [SamplingParams(temperature=1.5, top_k=1) for _ in range(3)])
    assert out.next_token_ids == logits.argmax(dim=-1).tolist()


def test_repetition_penalty_matches_hf():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 64, generator=g) * 3
    prompts = [[1, 2, 3, 3], [], [10, 11]]
    outputs = [[5, 1, 5], [7, 8], []]
    pens = [1.3, 0.7, 2.0]
    params = [SamplingParams(repetition_penalty=p) for p in pens]
    got = logits.clone()
    apply_penalties(got, params, outputs, prompts)
    for i in range(3):
        ids = torch.tensor([prompts[i] + outputs[i]])
        ref = RepetitionPenaltyLogitsProcessor(pens[i])(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(got[i], ref[0])
    # Tokens never seen are untouched.
    assert torch.equal(got[0, 20:], logits[0, 20:])


def test_presence_and_frequency_penalties_openai_semantics():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 32, generator=g)
    outputs = [[3, 3, 3, 9], [0, 31, 31], [], [4]]
    prompts = [[3, 5], [6], [1, 2], [4, 4]]  # prompt tokens are not penalised by presence/frequency
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(frequency_penalty=-1.0),
        SamplingParams(presence_penalty=2.0),
        SamplingParams(),
    ]
    got = logits.clone()
    apply_penalties(got, params, outputs, prompts)
    ref = logits.clone()
    for i, p in enumerate(params):
        counts = torch.bincount(torch.tensor(outputs[i], dtype=torch.long), minlength=32).float()
        ref[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    torch.testing.assert_close(got, ref)


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[5.0, 4.9, 0.0, -1.0]])
    # Without penalty token 0 wins; a seen token 0 with repetition penalty 1.2 drops to 5/1.2 < 4.9.
    assert run(logits.clone(), [SamplingParams(temperature=0)]).next_token_ids == [0]
    out = run(logits.clone(), [SamplingParams(temperature=0, repetition_penalty=1.2)], prompts=[[0]])
    assert out.next_token_ids == [1]
    out = run(logits.clone(), [SamplingParams(temperature=0, frequency_penalty=0.06)], outputs=[[0, 0]])
    assert out.next_token_ids == [1]
    out = run(logits.clone(), [SamplingParams(temperature=0, frequency_penalty=0.06)], outputs=[[0]])
    assert out.next_token_ids == [0]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_greedy_tokens_top_logprobs_start_with_it_when_logits_tie(k):
    # Regression: bf16 logits tie (' help' / ' assist' after "Hi" on an AMD EPYC); argmax took one token, topk listed
    # the other first, so a greedy reply's top_logprobs[0] named another token than the one returned.
    logits = torch.full((1, 40), -5.0)
    logits[0, [7, 21, 30]] = 3.0  # a three-way tie: argmax picks id 7
    out = run(logits.clone(), [SamplingParams(temperature=0.0)], outputs=[[]], prompts=[[]], lp=[True], top=[k])
    tl = out.logprobs[0]
    assert out.next_token_ids[0] == tl.token_id == 7
    assert len(tl.top) == k and [t for t, _ in tl.top][:3] == [7, 21, 30][:k]
    assert all(math.isclose(v, tl.logprob) for _, v in tl.top[:3])


def test_logprobs_are_raw_log_softmax_with_sorted_top():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 40, generator=g) * 2
    raw = torch.log_softmax(logits, dim=-1)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.5, top_k=5, presence_penalty=1.0),
        SamplingParams(temperature=1.0),
    ]
    out = run(
        logits.clone(),
        params,
        outputs=[[1, 2], [3], []],
        prompts=[[4], [], []],
        lp=[True, True, False],
        top=[5, 0, 3],
    )
    assert out.logprobs[2] is None
    for i in (0, 1):
        tl = out.logprobs[i]
        assert tl.token_id == out.next_token_ids[i]
        assert math.isclose(tl.logprob, raw[i, tl.token_id].item(), rel_tol=1e-5, abs_tol=1e-6)
    top = out.logprobs[0].top
    assert len(top) == 5 and out.logprobs[1].top == []
    vals = [v for _, v in top]
    assert vals == sorted(vals, reverse=True)
    ref_vals, ref_ids = torch.topk(raw[0], 5)
    assert [t for t, _ in top] == ref_ids.tolist()
    torch.testing.assert_close(torch.tensor(vals), ref_vals)


def reference_probs(logits_row, temperature, top_k, top_p, min_p):
    """Dense HF-warper reference distribution: temperature -> top-k -> top-p -> min-p."""
    x = (logits_row / temperature).unsqueeze(0)
    dummy = torch.zeros(1, 1, dtype=torch.long)
    if top_k > 0:
        x = TopKLogitsWarper(top_k)(dummy, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(dummy, x)
    if min_p > 0.0:
        x = MinPLogitsWarper(min_p)(dummy, x)
    return torch.softmax(x[0], dim=-1)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, -1, 1.0, 0.0), (0.7, 3, 1.0, 0.0), (1.3, -1, 0.6, 0.0), (1.0, -1, 1.0, 0.2), (0.9, 5, 0.8, 0.05)],
)
@pytest.mark.parametrize("candidates", [1024, 2])  # 2: the top-p nucleus is wider than the partial sort
def test_sampling_distribution_matches_hf_warpers(temperature, top_k, top_p, min_p, candidates, monkeypatch):
    monkeypatch.setattr(sampler_mod, "TOP_P_CANDIDATES", candidates)
    vocab, draws = 8, 6000
    row = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -3.0])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    torch.manual_seed(1234)
    out = run(row.repeat(draws, 1), [params] * draws)
    counts = torch.bincount(torch.tensor(out.next_token_ids), minlength=vocab).double()
    expected = reference_probs(row, temperature, top_k, top_p, min_p).double()
    # Filtered tokens are never drawn; kept ones appear with their probability (5 sigma binomial tolerance).
    assert torch.all(counts[expected == 0] == 0)
    sigma = torch.sqrt(draws * expected * (1 - expected))
    assert torch.all((counts - draws * expected).abs() <= 5 * sigma + 1), (counts / draws, expected)


def test_seeded_rows_reproducible_regardless_of_batch():
    g = torch.Generator().manual_seed(5)
    vocab = 1000
    row = torch.randn(vocab, generator=g)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    others = torch.randn(7, vocab, generator=g)
    results = []
    for position, batch_size in [(0, 1), (3, 7), (6, 7)]:
        logits = others[:batch_size].clone()
        logits[position] = row
        gens = [None] * batch_size
        tokens = []
        gen = torch.Generator().manual_seed(7)
        gens[position] = gen
        mixed = [SamplingParams(temperature=0.8, top_k=10) for _ in range(batch_size)]
        mixed[position] = params
        for _ in range(20):  # a sequence of steps with the row's own generator
            torch.manual_seed(len(tokens) + batch_size)  # the global RNG differs per run; it must not matter
            tokens.append(run(logits.clone(), mixed, gens=gens).next_token_ids[position])
        results.append(tokens)
    assert results[0] == results[1] == results[2]
    assert len(set(results[0])) > 1  # actually sampling, not greedy


SEEDED_TARGETS = [
    SamplingParams(temperature=0.8, seed=7),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7),
    SamplingParams(temperature=1.3, top_k=50, min_p=0.05, seed=7),
    SamplingParams(temperature=0.7, top_p=0.9999, seed=7),  # a nucleus wider than TOP_P_CANDIDATES: full sort
    SamplingParams(temperature=0.8, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3, seed=7),
]


@pytest.mark.parametrize("target", SEEDED_TARGETS, ids=["plain", "top_p", "top_k_min_p", "wide_top_p", "penalties"])
def test_seeded_row_beside_any_mix_of_rows_draws_the_same_tokens(target):
    """A seeded row's tokens depend only on its logits and generator: alone, or at any position beside greedy,
    top-k, top-p (narrow and wide), min-p, penalised, other-seeded and NaN rows, with or without logprobs."""
    vocab = 49152
    g = torch.Generator().manual_seed(0)
    row = torch.randn(vocab, generator=g) * 3
    others = torch.randn(8, vocab, generator=g) * 3
    others[5] = float("nan")
    neighbours = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=0.9, top_p=0.5),
        SamplingParams(temperature=1.0, top_p=0.99999),
        SamplingParams(temperature=0.6, min_p=0.2),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=1.1, repetition_penalty=1.5),
    ]
    runs = []
    for layout in range(5):
        rnd = random.Random(layout)
        chosen = rnd.sample(range(8), rnd.randrange(1, 9)) if layout else []
        pos = rnd.randrange(len(chosen) + 1)
        params = [neighbours[i] for i in chosen]
        params.insert(pos, target)
        rows = [others[i] for i in chosen]
        rows.insert(pos, row)
        gens: list = [torch.Generator().manual_seed(3) if p.seed is not None else None for p in params]
        gens[pos] = torch.Generator().manual_seed(7)
        tokens: list[int] = []
        for _ in range(12):
            outs = [[1, 2, 3, *tokens] if i == pos else [4, 5] for i in range(len(params))]
            lp = [rnd.random() < 0.5 for _ in params]
            top = [rnd.randrange(5) for _ in params]
            out = run(torch.stack(rows), params, outs, [[7, 8]] * len(params), gens, lp, top)
            tokens.append(out.next_token_ids[pos])
        runs.append(tokens)
    assert all(r == runs[0] for r in runs[1:]), runs
    assert len(set(runs[0])) > 1


def test_different_seeds_give_different_sequences():
    row = torch.zeros(1, 1000)  # uniform
    seqs = []
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        seqs.append([run(row.clone(), [SamplingParams(seed=seed)], gens=[gen]).next_token_ids[0] for _ in range(10)])
    assert seqs[0] != seqs[1]


def test_non_finite_rows_do_not_crash():
    vocab = 16
    logits = torch.randn(5, vocab)
    logits[0] = float("-inf")
    logits[1] = float("nan")
    logits[2, :] = float("-inf")
    logits[2, 11] = 3.0
    logits[3, 4] = float("nan")
    params = [
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.8, min_p=0.3),
        SamplingParams(temperature=1.0, top_k=4, top_p=0.9),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
    ]
    out = run(logits.clone(), params, lp=[True] * 5, top=[2] * 5)
    assert all(0 <= t < vocab for t in out.next_token_ids)
    assert out.next_token_ids[2] == 11  # the only finite logit
    assert out.next_token_ids[3] != 4  # a NaN logit is never chosen in a sampled row


def test_extreme_filters_keep_argmax():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 200, generator=g)
    params = [
        SamplingParams(top_p=1e-9),
        SamplingParams(min_p=1.0),
        SamplingParams(top_p=1e-9, min_p=1.0, top_k=3),
        SamplingParams(temperature=100.0, top_p=1e-9),
    ]
    for _ in range(5):
        out = run(logits.clone(), params)
        assert out.next_token_ids == logits.argmax(dim=-1).tolist()


def test_large_batch_with_penalties_runs():
    # Batch 64 x vocab 49152 with long prompts; checks correctness of a few rows against the dense definition.
    batch, vocab = 64, 49152
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(batch, vocab, generator=g)
    prompts = [torch.randint(0, vocab, (512,), generator=g).tolist() for _ in range(batch)]
    outputs = [torch.randint(0, vocab, (64,), generator=g).tolist() for _ in range(batch)]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2)
        if i % 2 == 0
        else SamplingParams(temperature=0.0)
        for i in range(batch)
    ]
    got = logits.clone()
    apply_penalties(got, params, outputs, prompts)
    for i in (0, 1, 62):
        ref = logits[i : i + 1].clone()
        if i % 2 == 0:
            ref = RepetitionPenaltyLogitsProcessor(1.1)(torch.tensor([prompts[i] + outputs[i]]), ref)
            counts = torch.bincount(torch.tensor(outputs[i]), minlength=vocab).float()
            ref[0] -= 0.2 * counts + 0.3 * (counts > 0).float()
        torch.testing.assert_close(got[i], ref[0])
    out = run(logits.clone(), params, outputs=outputs, prompts=prompts)
    assert out.next_token_ids == got.argmax(dim=-1).tolist()


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 4), [SamplingParams()], [[]] * 2, [[]] * 2, [None] * 2, [False] * 2, [0] * 2)
