"""The KL-logging convention the run-level kill switch reads (:mod:`.kl_logging`)."""
