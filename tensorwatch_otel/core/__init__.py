"""The core: hooks and frames, batch records and the ring, statistics, events, options,
naming and rank. It imports torch and the standard library only, never a sink."""
