"""The kernel: what every stage computes with, below all of them.

- :mod:`~glmpost.kernel.loading`: a checkpoint's tokenizer and model (quantized checkpoints
  dequantized, native or reference GLM-5 attention, the deterministic DSA top-k).
- :mod:`~glmpost.kernel.engine`: the embedded sampler (:class:`LocalEngine`), sampling parameters and
  per-sequence seeds; :mod:`~glmpost.kernel.continuation`: multi-turn KV caches.
- :mod:`~glmpost.kernel.distribution`: the distributions a log-prob can be of (log-prob kinds);
  :mod:`~glmpost.kernel.logprobs` and :mod:`~glmpost.kernel.heads`: the chunked log-prob head;
  :mod:`~glmpost.kernel.scoring`: teacher prefill and top-k scoring.
- :mod:`~glmpost.kernel.trust_masks`: which action tokens an update may learn from (IcePop, DIS),
  what the trainer applies and ``diff-logprobs`` measures.
- :mod:`~glmpost.kernel.sglang_client` (one server), :mod:`~glmpost.kernel.sglang_pool` (several) and
  :mod:`~glmpost.kernel.server_settings`: the engines' HTTP
  client and the probes a client runs before sampling from a server.

The kernel imports no stage package (rollout, rewards, rl, diff, teachers, server, weight_sync,
memory, spool, pipeline, commands): ``tests/test_architecture.py`` checks it.
"""
