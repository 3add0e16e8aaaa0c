"""Events rendered for people and files: the text report, the JSON lines codec, the diff of
two traced batches, and their pictures (plot.py, with the plot extra). Pure functions over core events."""
