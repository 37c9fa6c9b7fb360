"""verl trainer side (as ``verl/trainer/``): the plugin's v1 trainer modes, ``main_ppo`` and the start-up check.

* :mod:`~verl_mtp_plugin.trainer.config`: start-up validation of a verl config (``verl-mtp check``);
* :mod:`~verl_mtp_plugin.trainer.v1`: ``mtp_sync`` / ``mtp_colocate_async`` / ``mtp_separate_async``
  (verl's v1 trainers with rollout acceptance metrics and the desync guard);
* :mod:`~verl_mtp_plugin.trainer.main_ppo`: verl's ``main_ppo`` with the plugin's check and task runner
  (run as ``python -m verl_mtp_plugin.main_ppo``).

Importing this package imports none of them.
"""
