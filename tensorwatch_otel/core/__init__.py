"""The core, in rooms by responsibility: measure/ (statistics of tensors), frames/ (where frames
come from), batch/ (a batch's lifecycle, sampling, detection, replay), steps/ (optimizer
steps, the guard, skips); the shared vocabulary at this level (options, events, records,
errors, process state, names, ranks, the sink port, the fleet stop) and the watcher that wires
them. It imports torch and the standard library only, never a sink."""
