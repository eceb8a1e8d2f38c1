"""`starqa eval`: generated long-context tasks (generators), their scoring (scoring), the
in-process run of every method over the same samples (runner) and its terminal report."""
