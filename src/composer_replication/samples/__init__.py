"""What algorithms hand the trainer: training samples with their per-token weight streams, the loss components those streams feed, and their packing into micro-batches."""
