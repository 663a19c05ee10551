"""Live runs over the embedded runner: policy orchestration, generation and benchmarks.

Sits above ``speccal.runner`` and the policies (``speccal.policy``); the CLI and notebooks call it.
"""
