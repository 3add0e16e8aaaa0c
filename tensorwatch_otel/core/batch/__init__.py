"""The batch: its lifecycle from the outermost call to its record, which batches are measured
(sampling, the overhead budget), what a detection sets going (the pipeline: ring, capture,
replay, the verdict), the capture and replay of the offending batch, and the behaviour that
words and scopes it."""
