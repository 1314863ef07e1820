"""Inputs: suites (lm-eval task files, built-in suites, the data-dir mirror), their paths, templates and
prompt limits, answer grading, and the preparation of a sweep's prompts."""
