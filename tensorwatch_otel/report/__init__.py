"""Events rendered for people and files: the text report, the JSON lines codec, the diff of
two traced batches. Pure functions over core events."""
