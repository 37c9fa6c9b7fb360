"""What runs inside vLLM's worker processes: the worker extension (:mod:`.extension`, public path
``verl_mtp_plugin.rollout.worker_extension``), the drafter sync it drives (:mod:`.drafter_sync`) and the
drafter lookup on vLLM's model runners (:mod:`.drafter_lookup`).

Importing this package imports none of them.
"""
