"""Evaluation suites and their statistics (never a source of training data).

- :mod:`~composer_replication.evals.pass_at_k`: the unbiased pass@k estimator
  (arXiv 2107.03374) and the k values reported for n samples.
- :mod:`~composer_replication.evals.humaneval`: OpenAI's HumanEval (164 problems), graded in
  this project's sandbox.

A benchmark scores a model only if the model never trained on it, so the suites here are
refused as training environments: ``config.run.check_trainable_environment`` (the config
owns environment names) is called by the run config's ``EnvConfig`` and by
``build_environment``.
"""
