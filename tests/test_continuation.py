"""KV caches kept between turns (glmpost.kernel.continuation): a continued turn prefills only its
new tokens, and its samples and log-probs are those of the trajectory scored whole."""

from __future__ import annotations

import random

import pytest

from glmpost.kernel.continuation import TurnCaches
from glmpost.kernel.engine import LocalEngine, SamplingParams
from glmpost.kernel.loading import load_model

STOPS = list(range(20, 80))  # frequent enough that rows stop at different steps


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    # deterministic DSA top-k (the default): the same keys for the same tokens whatever the layout
    return LocalEngine(load_model(tiny_checkpoint), batch_size=3)


def _turns(engine, caches, *, turns=4, histories=5, seed=0, drop_every_turn=True):
    """Run ``turns`` turns of ``histories`` trajectories with random observations appended after each
    turn (one trajectory leaves per turn); per turn the prompts, keys and completions."""
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    histories_ids = [[rng.randrange(80, vocab) for _ in range(rng.randrange(3, 12))] for _ in range(histories)]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3, stop_token_ids=STOPS)
    active, log = list(range(histories)), []
    for turn in range(turns):
        prompts = [list(histories_ids[i]) for i in active]
        sessions = [f"t{i}" for i in active]
        keys = [f"t{i}#turn{turn}" for i in active]
        out = engine.generate(prompts, keys, params, sessions=sessions if caches is not None else None, caches=caches)
        log.append((prompts, out))
        for i, completion in zip(active, out):
            histories_ids[i] += completion.token_ids + [rng.randrange(80, vocab) for _ in range(rng.randrange(1, 6))]
        if drop_every_turn:
            active = active[1:]
    return log


def test_continued_turns_score_as_the_whole_trajectory(engine):
    """Every turn's rollout log-probs equal the engine's prefill scoring of the whole history
    (the trainer's formula) to 1e-5, fp32, while turns after the first prefill only their new ids."""
    caches = TurnCaches()
    log = _turns(engine, caches)
    worst = 0.0
    for prompts, out in log:
        scores = engine.score([p + c.token_ids for p, c in zip(prompts, out)], [len(p) for p in prompts])
        for completion, score in zip(out, scores):
            assert len(completion.log_probs) == len(score.log_probs) > 0
            worst = max(worst, max(abs(a - b) for a, b in zip(completion.log_probs, score.log_probs)))
    assert worst <= 1e-5
    first_turn = sum(len(p) for p in log[0][0])
    total = sum(len(p) for prompts, _ in log for p in prompts)
    assert caches.reused_tokens + caches.prefilled_tokens == total
    # later turns prefill at most the unfed end of the last action and the observation (<= 1 + 5 ids)
    later_prompts = sum(len(prompts) for prompts, _ in log[1:])
    assert first_turn <= caches.prefilled_tokens <= first_turn + 6 * later_prompts
    assert caches.reused_tokens > caches.prefilled_tokens


def test_continued_turns_sample_what_a_re_prefill_samples(engine):
    """Same seeds, same tokens: the cache changes how much is computed, not what is sampled."""
    cached = _turns(engine, TurnCaches())
    prefilled = _turns(engine, None)
    assert [[c.token_ids for c in out] for _, out in cached] == [[c.token_ids for c in out] for _, out in prefilled]
    assert [[c.finish_reason for c in out] for _, out in cached] == [[c.finish_reason for c in out] for _, out in prefilled]


def test_a_prompt_that_does_not_extend_its_cache_starts_over(engine):
    """A session whose new prompt rewrites its history (not an extension of the cached ids) is
    prefilled afresh in a new batch and still scores exactly; its stale cache is dropped."""
    caches = TurnCaches()
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1, stop_token_ids=STOPS)
    first = engine.generate([[30, 31, 32], [40, 41]], ["a", "b"], params, sessions=["a", "b"], caches=caches)
    rewritten = [33, 31, 32] + first[0].token_ids + [50]  # first id changed
    extended = [40, 41] + first[1].token_ids + [51, 52]
    before = caches.prefilled_tokens
    second = engine.generate([rewritten, extended], ["a#turn1", "b#turn1"], params, sessions=["a", "b"], caches=caches)
    assert caches.prefilled_tokens - before >= len(rewritten)  # a whole prefill for "a"
    assert len(caches.batches) == 2  # "b" continued its batch, "a" got a fresh one
    scores = engine.score([rewritten + second[0].token_ids, extended + second[1].token_ids], [len(rewritten), len(extended)])
    for completion, score in zip(second, scores):
        assert max(abs(a - b) for a, b in zip(completion.log_probs, score.log_probs)) <= 1e-5


def test_sessions_must_match_the_prompts(engine):
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="one session per prompt"):
        engine.generate([[30, 31]], ["a"], params, sessions=[], caches=TurnCaches())


def test_prefix_lookups_keep_the_rows_a_call_did_not_continue(engine):
    """Without sessions (glmpost serve), a prompt finds the row whose ids it extends; rows of the
    same batch that a later call continues are still cached then, and each reads its own prefix."""
    caches = TurnCaches(retain=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=2, stop_token_ids=[])
    prompts = [[90, 91, 92], [93, 94], [95, 96, 97, 98]]
    first = engine.generate(prompts, ["a", "b", "c"], params, caches=caches)
    extended = [p + c.token_ids + [99, 100] for p, c in zip(prompts, first)]
    one = engine.generate([extended[1]], ["b1"], params, caches=caches)
    assert caches.last_reused == [len(prompts[1]) + 4]  # its prompt and the 4 fed tokens
    rest = engine.generate([extended[2], extended[0]], ["c1", "a1"], params, caches=caches)
    assert caches.last_reused == [len(prompts[2]) + 4, len(prompts[0]) + 4]
    scores = engine.score([extended[1] + one[0].token_ids, extended[2] + rest[0].token_ids, extended[0] + rest[1].token_ids],
                          [len(extended[1]), len(extended[2]), len(extended[0])])
    for completion, score in zip(one + rest, scores):
        assert max(abs(a - b) for a, b in zip(completion.log_probs, score.log_probs)) <= 1e-5
    assert len(caches.batches) <= 4
