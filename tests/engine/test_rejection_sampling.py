"""Rejection sampling keeps the target's distribution (temperature > 0, unseeded requests):
chi-square tests, deterministic (fixed seeds), with drafts that disagree with the target on
purpose -- on synthetic rows for point-mass (n-gram) and full (draft model) proposals, and
through the engine against plain sampling of the same model."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sample.sampler import Sampler
from splitserve.engine.speculative.rejection_sampler import RejectionSampler
from splitserve.engine.speculative.verify_row import VerifyRow
from splitserve.proto.messages.sampling_params import SamplingParams

SIGNIFICANCE = 0.01


def chi_square_p_value(observed: list[float], expected: list[float]) -> float:
    """Pearson's goodness-of-fit test; cells expected below 1e-9 must be observed empty."""
    stat, cells = 0.0, 0
    for o, e in zip(observed, expected):
        if e < 1e-9:
            assert o == 0, "a token the target never emits was emitted"
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    return float(torch.special.gammaincc(torch.tensor((cells - 1) / 2.0), torch.tensor(stat / 2.0)))


def contingency_p_value(a: Counter, b: Counter) -> float:
    """Chi-square test that two samples come from one distribution (2 x cells table)."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for key in keys:
        total = a[key] + b[key]
        for count, n in ((a[key], na), (b[key], nb)):
            expected = total * n / (na + nb)
            stat += (count - expected) ** 2 / expected
    return float(torch.special.gammaincc(torch.tensor((len(keys) - 1) / 2.0), torch.tensor(stat / 2.0)))


class _Seq:
    """What the verifier reads of a sequence (unseeded, temperature 1)."""

    def __init__(self, params: SamplingParams):
        self.request_id = "r"
        self.params = params
        self.prompt_token_ids = [1]
        self.output_token_ids: list[int] = []
        self.num_output_tokens = 0


@pytest.mark.parametrize("proposal", ["point_mass", "distribution"])
def test_rejection_sampling_emits_the_target_distribution(proposal):
    torch.manual_seed(0)
    vocab = 6
    rows = torch.randn(3, vocab) * 1.5  # the target's logits at the draft's 2 positions + bonus
    params = SamplingParams(temperature=0.7, top_k=5, max_tokens=8)
    sampler = Sampler(seed=123)
    verifier = RejectionSampler(sampler)
    target = [Sampler.sampling_probs(rows[j], params) for j in range(3)]
    # Drafts that disagree with the target: its second choice first (then its least likely
    # token still allowed), which it emits far less often than a point mass or q says.
    fixed_draft = [int(torch.argsort(target[0])[-2]), int(torch.argsort(target[1])[1])]
    q = None  # n-gram: the draft is certain
    if proposal == "distribution":  # a draft model: the draft is sampled from its q
        q = torch.full((2, vocab), 0.05)
        q[0, fixed_draft[0]] = 0.75  # far too sure of a token the target finds unlikely
        q[1] = torch.softmax(torch.randn(vocab), dim=-1)
    draft_gen = torch.Generator().manual_seed(5)
    seq = _Seq(params)
    num_trials = 20000
    first, second, accepted = Counter(), Counter(), 0
    for _ in range(num_trials):
        draft = fixed_draft if q is None else [int(torch.multinomial(q[j], 1, generator=draft_gen)) for j in range(2)]
        tokens = verifier._rejection_sample(rows, draft, q, VerifyRow(seq, []))
        first[tokens[0]] += 1
        accepted += len(tokens) > 1
        if len(tokens) > 1:
            second[tokens[1]] += 1  # the token after an accepted first draft token
    assert (
        chi_square_p_value([first[t] for t in range(vocab)], [num_trials * float(p) for p in target[0]]) > SIGNIFICANCE
    )
    n_second = sum(second.values())
    assert n_second > 1000
    assert (
        chi_square_p_value([second[t] for t in range(vocab)], [n_second * float(p) for p in target[1]]) > SIGNIFICANCE
    )
    # Kept with probability sum_x q(x) min(1, p(x)/q(x)) = sum_x min(q(x), p(x)): the test saw
    # both acceptances and rejections.
    q_first = torch.zeros(vocab) if q is None else q[0]
    if q is None:
        q_first[fixed_draft[0]] = 1.0
    expected_rate = float(torch.minimum(q_first, target[0]).sum())
    assert 0.005 < expected_rate < 0.9
    assert accepted / num_trials == pytest.approx(expected_rate, abs=0.01)


class SecondChoiceProposer:
    """Drafts, after each first output token, the target's second most likely next token."""

    def __init__(self, prompt_len: int, second_choice: dict[int, int]):
        self.prompt_len = prompt_len
        self.second_choice = second_choice

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if len(tokens) == self.prompt_len + 1 and tokens[-1] in self.second_choice:
            return [self.second_choice[tokens[-1]]]
        return []


def test_engine_sampling_distribution_matches_plain_sampling(tiny_model):
    prompt = [5, 6, 7, 8]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    num_samples = 1500

    plain_engine = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=1024, max_num_seqs=256, seed=7))
    # The target's top choices after each possible first token.
    firsts = sorted({t for o in plain_engine.generate([prompt] * 64, params) for t in o.token_ids[:1]})
    top = SamplingParams(temperature=0, max_tokens=1, logprobs=True, top_logprobs=2)
    second_choice = {
        t: out.top_logprobs[0][1][0]
        for t, out in zip(firsts, plain_engine.generate([prompt + [t] for t in firsts], top))
    }
    plain = [tuple(o.token_ids) for o in plain_engine.generate([prompt] * num_samples, params)]
    spec_engine = LLMEngine(
        EngineConfig(
            model=tiny_model,
            num_kv_blocks=1024,
            max_num_seqs=256,
            seed=11,
            speculative={"method": "ngram", "policy": "fixed", "num_speculative_tokens": 1},
        )
    )
    spec_engine.speculator.proposer = SecondChoiceProposer(len(prompt), second_choice)
    spec = [tuple(o.token_ids) for o in spec_engine.generate([prompt] * num_samples, params)]
    stats = spec_engine.stats()
    assert stats.spec_num_drafts > 0.9 * num_samples
    assert 0.1 < stats.spec_accepted_tokens / stats.spec_proposed_tokens < 0.9  # both outcomes, often
    for cells in (lambda s: s[:2], lambda s: s[1:]):  # (t1, t2) and (t2, t3): the draft's and the bonus'
        assert contingency_p_value(Counter(map(cells, plain)), Counter(map(cells, spec))) > SIGNIFICANCE
