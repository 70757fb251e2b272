"""The tuning loop: from the latency outliers telemetry attributes to a change that answers
them, applied one at a time, verified over as many windows as it was proposed on, kept or
reverted on its own.

`settings` holds the [tuning] table, `verdict` the statistical rule that judges a change,
`ledger` the loop's record (proposals, kept and reverted changes with their figures, the
failed ones not to retry, the hourly budget) that `edgectl tune` lists, and `loop` the state
machine the daemon feeds every telemetry window. The changes themselves are sysconf's: the
actions' catalogue (sysconf.actions) and the journal `edgectl revert` restores."""
