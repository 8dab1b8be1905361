"""Evaluation metrics of one prompt's n judged samples: avg@n, pass@k (unbiased) and maj@n.

Pure functions on counts and lists; :mod:`glmpost.evaluation.run` applies them per prompt and
averages them over the prompts of each domain and over all prompts.
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Optional, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from ``n`` samples of which ``c`` are correct (Chen et al.
    2021, "Evaluating Large Language Models Trained on Code"):

        pass@k = 1 - C(n - c, k) / C(n, k)

    the probability that a set of ``k`` samples drawn without replacement from the ``n`` holds at
    least one correct sample. Computed in the numerically stable product form
    ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (no large binomials); it is exactly 1 when
    ``n - c < k`` (every k-subset holds a correct sample). Needs ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def avg_at_k(correct: Sequence[bool]) -> float:
    """avg@n: the mean correctness over the ``n`` samples, ``c / n`` (= the expected pass@1; the
    mean over prompts is the usual "avg@n" of reasoning benchmarks)."""
    if not correct:
        raise ValueError("avg@k needs at least one sample")
    return sum(bool(x) for x in correct) / len(correct)


def majority_answer(answers: Sequence[Optional[Hashable]]) -> Optional[int]:
    """The index of the sample whose answer wins the majority vote, or None when no sample has an
    answer. The winner is the most frequent answer among the samples with one (``None`` does not
    vote); a tie goes to the answer that appears first in sample order, and the index returned is
    that answer's first sample."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(i for i, a in enumerate(answers) if a is not None and counts[a] == best)


def maj_at_k(answers: Sequence[Optional[Hashable]], correct: Sequence[bool]) -> float:
    """maj@n: 1.0 when the majority answer (:func:`majority_answer`: most frequent extracted
    answer over the ``n`` samples, ties to the answer seen first) is correct, judged by the
    correctness of its first sample; 0.0 when it is not, or when no sample has an answer."""
    if len(answers) != len(correct):
        raise ValueError(f"maj@k: {len(answers)} answers but {len(correct)} correctness values")
    winner = majority_answer(answers)
    return float(winner is not None and bool(correct[winner]))
