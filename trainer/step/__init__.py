"""One training step of the policy: the rows it trains on, the model it runs, the loss it takes.

- :mod:`.feed`: the trainer's side of the rollout queue (samples -> staleness filter -> token-budget
  batches -> packed rows), the iterable the ``transformers.Trainer`` loop pulls micro-batches from;
- :mod:`.packing`: a row of samples as a prefix trie laid out depth-first, and the token-budget batcher;
- :mod:`.modeling`: loading the policy and its tokenizer as the spec says, and the checks on them;
- :mod:`.attention`: tree attention (each token attends along its path in the row's trie);
- :mod:`.linear_attention`: tree packing for gated DeltaNet layers (Qwen3-Next / Qwen3.5 hybrids);
- :mod:`.compiled_layers`: each decoder layer compiled whole, tree attention inside;
- :mod:`.loss`: the policy loss (score centering or the clipped surrogate, masked importance sampling);
- :mod:`.fused_head`: the LM head fused with the loss's reads.

The training loop around them is :mod:`trainer.trainer`.
"""
