"""The native training loop: the run lifecycle (shared by the backends), the
algorithm-blind step, the learner, teachers, checkpoints and the rollout queue.

Nothing here imports a backend or the seed API's trl names: those are the face
:mod:`composer_replication.trainer`.
"""
