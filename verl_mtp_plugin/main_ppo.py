"""``python -m verl_mtp_plugin.main_ppo``: verl's PPO/GRPO entry point with the plugin's trainers.

Same arguments as ``python -m verl.trainer.main_ppo``; the implementation (start-up check, task runner,
refusal of the legacy trainer) is :mod:`verl_mtp_plugin.trainer.main_ppo`.
"""

from __future__ import annotations

import sys

from verl_mtp_plugin.trainer.main_ppo import main, verl_relative_config_path

__all__ = ["main"]

if __name__ == "__main__":
    sys.argv[1:] = verl_relative_config_path(sys.argv[1:])
    # main is defined in an importable module, so Ray pickles MTPTaskRunner by reference
    main()
