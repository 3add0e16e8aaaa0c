"""Optimizer steps as the watcher sees them: the step hooks and the guard that checks a step's
gradients before it runs, GradScaler's skipped steps, on_detect's choices (raise, report,
skip) and the verdicts that skip a spoilt step, the optimizer state reader."""
