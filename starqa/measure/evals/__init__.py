"""`starqa eval`: generated long-context tasks (generators; repo_qa derives the questions
about a real package's code), their scoring (scoring), the in-process run of every method
over the same samples (runner) and its terminal report."""
