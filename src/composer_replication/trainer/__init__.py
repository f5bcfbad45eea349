"""The trainer: loss components, the algorithm-blind step, teacher models."""
