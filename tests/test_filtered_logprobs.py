"""Log-probs under top-k / top-p truncation and the log-prob kinds (glmpost.kernel.distribution):
the train-side chunked paths compute exactly what the engine records (TRL#6789: an IS ratio that
ignores truncation measures the truncation, not the engines)."""

from __future__ import annotations

import math

import pytest
import torch

from glmpost.kernel.distribution import (
    LOG_PROB_FLOOR,
    LOG_PROB_KINDS,
    ScoredDistribution,
    distribution_log_softmax,
    keep_mask,
    scored_distribution,
)
from glmpost.kernel.engine import LocalEngine, SamplingParams
from glmpost.kernel.logprobs import sequence_log_probs, token_log_probs_from_hidden
from glmpost.models.tiny import build_model, tiny_glm5_config

FILTER = {"temperature": 0.7, "top_k": 20, "top_p": 0.9}  # the round-trip settings


@pytest.fixture(scope="module")
def model():
    from glmpost.npu.topk import set_indexer_topk

    model = build_model(tiny_glm5_config(), seed=0)
    set_indexer_topk(model, deterministic=True)  # as load_model does: left-padded decode = full forward
    return model


def _lse(values):
    return math.log(sum(math.exp(v) for v in values))


def test_hand_computed_top_k_and_top_p_log_probs():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 3)
    eye = torch.eye(4)
    targets = torch.tensor([0, 1, 2])
    # top-k 2 keeps {0, 1}: log p(0) = 2 - log(e^2 + e^1); token 2 is outside the set.
    top_k = token_log_probs_from_hidden(logits, eye, targets, top_k=2, return_entropy=True)
    kept = torch.tensor([2.0, 1.0])
    p = torch.softmax(kept, dim=0)
    assert top_k.log_probs[0].item() == pytest.approx(2 - _lse([2, 1]), abs=1e-6)
    assert top_k.log_probs[1].item() == pytest.approx(1 - _lse([2, 1]), abs=1e-6)
    assert top_k.log_probs[2].item() == LOG_PROB_FLOOR
    assert top_k.entropy[0].item() == pytest.approx(float(-(p * p.log()).sum()), abs=1e-6)
    # softmax([2, 1, 0, -1]) = [.644, .237, .087, .032]: top-p 0.9 keeps the token crossing 0.9
    # (mass before it .881 < .9), so {0, 1, 2}; at T = 2 the mass spreads: .4 + .24 + .15 = .79 < .9
    # keeps all four.
    top_p = token_log_probs_from_hidden(logits, eye, targets, top_p=0.9)
    assert top_p.log_probs[2].item() == pytest.approx(0 - _lse([2, 1, 0]), abs=1e-6)
    hot = token_log_probs_from_hidden(logits, eye, targets, top_p=0.9, temperature=2.0)
    assert hot.log_probs[2].item() == pytest.approx(0 - _lse([1, 0.5, 0, -0.5]), abs=1e-6)


def test_keep_mask_top_k_ties_and_top_p_after_top_k():
    scaled = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    assert keep_mask(scaled, top_k=2, top_p=1.0).tolist() == [[True, True, True, False]]  # the tie stays
    # top-p acts on the top-k distribution: after top-k 3, p = softmax([3, 1, 1]) = [.787, .107, .107],
    # so top-p 0.85 keeps 3.0 and the first 1.0 by sort order... both 1.0 tokens have mass .787 before
    # one of them, .893 before the other: exactly one is dropped.
    kept = keep_mask(scaled, top_k=3, top_p=0.85)
    assert kept[0, 0] and not kept[0, 3] and int(kept.sum()) == 2


@pytest.mark.parametrize("path", ["no_grad", "grad"])
def test_sequence_log_probs_match_the_filtered_full_forward(model, path):
    # Greedy continuations (argmax: inside every kept set) with every fourth token replaced by a
    # random id (most likely outside it).
    prompts, completions = _sample(model, SamplingParams(temperature=0.0, max_new_tokens=15), prompts=((5, 9, 17, 2), (44, 3, 8, 1)))
    input_ids = torch.tensor([list(p) + c.token_ids for p, c in zip(prompts, completions)])
    input_ids[:, 3::4] = torch.randint(0, 512, input_ids[:, 3::4].shape, generator=torch.Generator().manual_seed(3))
    logits = model(input_ids=input_ids, use_cache=False).logits.float()[:, :-1]
    dist = ScoredDistribution(**FILTER)
    reference = distribution_log_softmax(logits.detach(), dist)
    targets = input_ids[:, 1:]
    ref = reference.gather(-1, targets[..., None]).squeeze(-1)
    context = torch.no_grad() if path == "no_grad" else torch.enable_grad()
    with context:
        out = sequence_log_probs(model, input_ids, chunk_size=5, return_entropy=True, **FILTER)
    inside = torch.isfinite(ref)
    assert 0 < int(inside.sum()) < inside.numel()  # random ids: some in the kept set, some not
    torch.testing.assert_close(out.log_probs[inside], ref[inside], atol=1e-5, rtol=0)
    assert torch.all(out.log_probs[~inside] == LOG_PROB_FLOOR)
    p = reference.exp()
    entropy = -(p * torch.where(p > 0, reference, torch.zeros_like(reference))).sum(-1)
    torch.testing.assert_close(out.entropy, entropy, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fused", [True, False])
def test_filtered_gradients_hold_the_kept_set_fixed(fused):
    """d log p_S(y) / dz = onehot(y) - p_S (S fixed); an out-of-set target gets no gradient."""
    torch.manual_seed(0)
    hidden = torch.randn(7, 8, dtype=torch.float64).float()
    weight = torch.randn(30, 8).requires_grad_()
    targets = torch.randint(0, 30, (7,))
    dist = ScoredDistribution(0.8, 6, 0.95)
    with torch.no_grad():
        logits = hidden @ weight.T
        kept = keep_mask(logits / 0.8, top_k=6, top_p=0.95)
        targets[:5] = torch.multinomial(kept[:5].float(), 1).squeeze(-1)  # five targets in the set
    assert not bool(kept[torch.arange(7), targets][5:].all())
    if fused:
        out = token_log_probs_from_hidden(hidden, weight, targets, chunk_size=3, return_entropy=True, temperature=0.8,
                                          top_k=6, top_p=0.95)
    else:
        from tests.test_logprobs import _checkpointed

        out = _checkpointed(hidden, weight, targets, chunk_size=3, return_entropy=True, temperature=0.8, top_k=6, top_p=0.95)
    g = torch.arange(1.0, 8.0)
    (grad,) = torch.autograd.grad(((out.log_probs + 0.1 * out.entropy) * g).sum(), [weight])
    z = (hidden @ weight.T) / 0.8
    log_p = torch.log_softmax(z.masked_fill(~kept, -torch.inf), dim=-1)
    in_set = kept[torch.arange(7), targets]
    lp = torch.where(in_set, log_p.gather(-1, targets[:, None]).squeeze(-1), torch.zeros(7))
    ent = -(log_p.exp() * torch.where(kept, log_p, torch.zeros_like(log_p))).sum(-1)
    (expected,) = torch.autograd.grad(((lp + 0.1 * ent) * g).sum(), [weight])
    assert dist.filtered and grad.abs().max() > 0
    torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-4)


def _sample(model, params, *, prompts=((5, 9, 17, 2), (44, 3), (7, 7, 7, 30, 1))):
    engine = LocalEngine(model, batch_size=3)
    keys = [f"p{i}/0" for i in range(len(prompts))]
    return prompts, engine.generate([list(p) for p in prompts], keys, params)


def _train_side(model, prompts, completions, **distribution):
    """The trainer's log-probs of each completion's tokens on its own prefix (one sequence at a time)."""
    values = []
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([list(prompt) + completion.token_ids])
        with torch.no_grad():
            out = sequence_log_probs(model, ids, response_start=len(prompt), **distribution)
        values += out.log_probs[out.mask].tolist()
    return torch.tensor(values), torch.tensor([v for c in completions for v in c.log_probs])


def test_engine_records_what_the_train_side_recomputes_under_truncation(model):
    params = SamplingParams(max_new_tokens=24, seed=1, **FILTER)
    prompts, completions = _sample(model, params)
    train, recorded = _train_side(model, prompts, completions, **FILTER)
    assert recorded.numel() > 40
    assert float((train - recorded).abs().max()) <= 1e-5  # a KV-cache decode vs a full forward
    # Ignoring the truncation on the train side is far off: the ratio would measure the filter.
    ignored, _ = _train_side(model, prompts, completions, temperature=FILTER["temperature"])
    assert float((ignored - recorded).abs().mean()) > 0.05
    assert bool((ignored <= recorded + 1e-6).all())  # renormalising over fewer tokens only raises p


@pytest.mark.parametrize("kind", sorted(LOG_PROB_KINDS))
def test_each_kind_is_what_its_distribution_scores(model, kind):
    params = SamplingParams(max_new_tokens=12, seed=2, log_prob_kind=kind, **FILTER)
    prompts, completions = _sample(model, params)
    # The kind never changes the tokens sampled, only what is recorded about them.
    _, sampled = _sample(model, SamplingParams(max_new_tokens=12, seed=2, **FILTER))
    assert [c.token_ids for c in completions] == [c.token_ids for c in sampled]
    dist = scored_distribution(kind, **FILTER)
    train, recorded = _train_side(model, prompts, completions, temperature=dist.temperature, top_k=dist.top_k,
                                  top_p=dist.top_p)
    assert float((train - recorded).abs().max()) <= 1e-5
    assert params.to_json()["log_prob_kind"] == kind


def test_greedy_records_the_raw_log_probs(model):
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    prompts, completions = _sample(model, params)
    assert params.to_json()["log_prob_kind"] == "raw"
    train, recorded = _train_side(model, prompts, completions)  # temperature 1, no filter
    assert float(recorded.max()) < 0  # not the point mass's 0
    assert float((train - recorded).abs().max()) <= 1e-5


def test_kinds_read_back_from_records():
    assert SamplingParams.from_record({"temperature": 0.7, "top_k": -1}).scored() == ScoredDistribution(0.7)
    assert SamplingParams.from_record({**FILTER, "log_prob_kind": "sampled"}).scored() == ScoredDistribution(**FILTER)
    assert SamplingParams.from_record({**FILTER, "log_prob_kind": "tempered"}).scored() == ScoredDistribution(0.7)
    assert SamplingParams.from_record({**FILTER, "log_prob_kind": "raw"}).scored() == ScoredDistribution()
    assert SamplingParams.from_record({**FILTER, "log_prob_kind": "top_p_renormalized"}).scored() == \
        ScoredDistribution(0.7, 0, 0.9)
    assert SamplingParams.from_record({"temperature": 0, "log_prob_kind": "raw"}).scored() == ScoredDistribution()
    with pytest.raises(ValueError, match="undefined at temperature 0"):
        SamplingParams.from_record({"temperature": 0}).scored()  # glmpost before kinds: the point mass's 0
    with pytest.raises(ValueError, match="sampling.log_prob_kind: unknown log-prob kind 'filtered'"):
        SamplingParams.from_record({"log_prob_kind": "filtered"})
