"""Analysis of run directories: metrics, the analyzer, the gate and its report, diffs of two runs, and
the load axis of server audits."""
