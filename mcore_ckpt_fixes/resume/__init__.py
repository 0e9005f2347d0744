"""The resume check: does a run that saves, stops and resumes continue exactly as one that never stopped?

Run A trains N steps uninterrupted; run B trains K < N steps and saves; run C starts new
processes, builds the same job, loads and trains the remaining N - K steps. A and C are compared
per rank, bit for bit: the loss of every resumed step, every parameter, every optimizer state
tensor and scalar, the learning-rate scheduler and every RNG stream (Python, NumPy, torch, each
named stream of Megatron's RNG tracker). The job trains with Megatron's own parts and checkpoints
through ``megatron.training.checkpointing`` (:mod:`..testing.gpt_job`), through Megatron-Bridge's own
``save_checkpoint`` / ``load_checkpoint`` (:mod:`.bridge`) or verl's ``MegatronCheckpointManager``
(:mod:`.verl`), or, for a non-colocated MIMO model,
through ``MimoOptimizer`` and ``dist_checkpointing`` as a MIMO user does (:mod:`.mimo`); the configurations are in
:mod:`.configs`; ``mcore-ckpt-fixes selftest --resume`` runs it on the user's stack.

Nothing here is imported by ``import mcore_ckpt_fixes``.
"""
