"""verl engine side (as ``verl/workers/engine/``): the plugin's Megatron engine and its registration.

* :mod:`~verl_mtp_plugin.engine.settings`: what one engine checks and sets at build time (no verl import);
* :mod:`~verl_mtp_plugin.engine.megatron`: ``NemotronHMTPMegatronEngine`` (per-phase MTP forward,
  pre-wrap hook, MTP metrics) on verl's ``MegatronEngineWithLMHead``;
* :mod:`~verl_mtp_plugin.engine.registry`: registration with verl's ``EngineRegistry`` under
  ``model_type: nemotron_h_mtp``.

Importing this package imports none of them (the start-up check reads the settings without verl's engines).
"""
