"""Measuring starqa: `starqa bench` (speed, memory, communication of every method) and
`starqa eval` (accuracy on generated long-context tasks)."""
