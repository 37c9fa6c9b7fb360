"""Trainer-side monitoring of the rollout: speculative-decoding metrics from vLLM's counters
(:mod:`.spec_metrics`), the drafter-desync guard (:mod:`.desync_guard` rules, :mod:`.desync_messages` what a
user reads) and the two joined as one object the trainer calls (:mod:`.spec_monitor`).

Importing this package imports none of them.
"""
